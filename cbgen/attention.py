"""Paged attention, plugged into transformers through its ``AttentionInterface``.

The model runs once per step over all scheduled tokens packed into a single
sequence (batch dimension 1). Each attention layer calls ``paged_attention``,
which stores the step's new K/V in the paged cache and then attends, for every
request, over that request's own cached tokens:

* with the native kernel (``cbgen.kernels``) and one cache group, every row of
  the step, decode or prefill, is a query over its own request's blocks up to its
  own position, and one kernel call per layer attends them all (the chunk's own
  K/V are stored first);
* otherwise decode rows (one new token per request) go through one batched
  grouped matmul over K/V gathered from the block tables, masked past each
  context, and prefill chunks through torch SDPA one request at a time, causal
  within the chunk and over everything cached before it.

Layers attend through their cache group's block tables (``GroupTables``): a
sliding-window group's tables start at the first block its window still reads
(older blocks went back to the free list), with context lengths and key
positions shifted to match, so windowed layers only ever read the window.

What the function needs beyond the layer's tensors (slot mapping, block tables,
the cache itself) comes from the step's ``AttentionMetadata``, installed for the
duration of ``model.forward`` with ``attention_context``; a thread-local keeps
concurrent engines (one per thread) apart.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .cache.paged_cache import LayerSpec, PagedKVCache

ATTENTION_NAME = "cbgen_paged"


@dataclass
class PrefillSpan:
    """One request's prefill chunk: ``q_len`` query rows at ``q_start`` of the packed batch."""

    q_start: int
    q_len: int
    context_len: int  # tokens cached before this chunk + q_len
    mask: torch.Tensor | None  # [q_len, context_len] causal, when tokens were cached before


@dataclass
class GroupTables:
    """One cache group's tables for a step, read by every layer of the group.

    A windowed group's decode tables start at the first block in the window:
    ``decode_context_lens`` count tokens from that block's first position.
    ``prefill_blocks`` has, per prefill span, the blocks holding its keys from
    position ``key_start`` to ``context_len`` (``None``: a fresh chunk, whose keys
    are its own) and that ``key_start``.
    """

    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token
    decode_block_tables: torch.Tensor | None = None  # [decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [decodes]
    decode_padding_mask: torch.Tensor | None = None  # [1, decodes, 1, max_blocks*block_size]
    prefill_blocks: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """A step's attention inputs.

    With one cache group the metadata carries that group's tables itself (the
    fields it shares with ``GroupTables``); with several, ``groups`` holds one
    ``GroupTables`` per group and ``layer_group`` maps each layer to its group.
    """

    cache: PagedKVCache
    layer_of_module: dict[int, int]
    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token
    decode_rows: torch.Tensor | None = None  # [decodes] row of each decode token in the batch
    decode_block_tables: torch.Tensor | None = None  # [decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [decodes]
    decode_padding_mask: torch.Tensor | None = None  # [1, decodes, 1, max_blocks*block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_only: bool = False  # every row is a decode row, in order: no gather/scatter of q
    decode_kernel: Any = None  # the native paged decode kernel module, when built
    prefill_blocks: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)
    # With the kernel and one cache group, a step with prefill rows also gets a table
    # and a context length per row ([tokens, width], [tokens]): each prefill row is a
    # query of its own over its request's cache, up to its position, and the kernel
    # attends every row of the step in one call. A 450-token chunk took 2.2 ms a layer
    # that way against 3.6 ms in SDPA, which also wanted the cached keys gathered.
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None
    groups: list[GroupTables] = field(default_factory=list)
    layer_group: list[int] = field(default_factory=list)  # layer -> index into groups


@dataclass
class ProbeRecord:
    """Filled by a probe forward: one ``LayerSpec`` per attention module, in call order.

    Each spec holds what the layer's attention call showed: K/V heads and head sizes
    (from the tensors), dtype, and the ``sliding_window`` the module passed.
    """

    layer_of_module: dict[int, int] = field(default_factory=dict)
    layers: list[LayerSpec] = field(default_factory=list)


_state = threading.local()


@contextmanager
def attention_context(metadata: AttentionMetadata | ProbeRecord) -> Iterator[None]:
    previous = getattr(_state, "metadata", None)
    _state.metadata = metadata
    try:
        yield
    finally:
        _state.metadata = previous


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` is ``[1, heads, tokens, dim]``, ``key``/``value`` ``[1, kv_heads, tokens, dim]``.

    Returns ``[1, tokens, heads, value_dim]`` as transformers' attention modules expect.
    """
    metadata = getattr(_state, "metadata", None)
    if metadata is None:
        raise RuntimeError(
            f"the '{ATTENTION_NAME}' attention only runs inside a cbgen engine step; "
            "restore the model's attention implementation (EngineCore.close()) to use it elsewhere"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by cbgen yet")
    if query.shape[0] != 1:
        raise RuntimeError(f"cbgen packs every step into batch size 1, got {query.shape[0]}")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])

    # Head-major throughout, as transformers hands the tensors over: no transposes.
    q, k, v = query[0], key[0], value[0]  # [heads, tokens, dim], [kv_heads, tokens, dim]

    if isinstance(metadata, ProbeRecord):
        return _probe(metadata, module, q, k, v, scale, sliding_window)

    out = attend(
        metadata, metadata.layer_of_module[id(module)], q, k, v, scale, sliding_window, softcap
    )
    return out.unsqueeze(0), None


def attend(
    metadata: AttentionMetadata,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    store: bool = True,
) -> torch.Tensor:
    """Store layer ``layer``'s new K/V in the paged cache (unless the caller already
    did: ``store=False``), then attend.

    ``q`` is ``[heads, tokens, dim]``, ``k``/``v`` ``[kv_heads, tokens, dim]`` (views
    of any layout). Returns ``[tokens, heads, value_dim]``. Both the transformers
    attention hook above and the decoder fast path (``cbgen.fast_forward``) call it.
    """
    tables = layer_tables(metadata, layer)
    cache = metadata.cache
    if store:
        cache.write(layer, tables.slot_mapping, k, v)
    key_cache, value_cache = cache.keys[layer], cache.values[layer]

    kernel = metadata.decode_kernel

    def kernel_decode(
        q_rows: torch.Tensor,  # [heads, rows, dim]
        block_tables: torch.Tensor | None = tables.decode_block_tables,
        context_lens: torch.Tensor | None = tables.decode_context_lens,
    ) -> torch.Tensor:
        return kernel.paged_decode_attention(
            q_rows.transpose(0, 1).contiguous(),
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window or 0,
            softcap or 0.0,
        )

    if metadata.decode_only and kernel is not None:
        return kernel_decode(q)
    if metadata.row_block_tables is not None and kernel is not None:
        return kernel_decode(q, metadata.row_block_tables, metadata.row_context_lens)
    if metadata.decode_only:
        out = _decode_attention(q, key_cache, value_cache, tables, scale, sliding_window, softcap)
        return out.transpose(0, 1)

    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if metadata.decode_rows is not None and kernel is not None:
        decoded = kernel_decode(q.index_select(1, metadata.decode_rows))
        out[:, metadata.decode_rows] = decoded.transpose(0, 1)
    elif metadata.decode_rows is not None:
        out[:, metadata.decode_rows] = _decode_attention(
            q.index_select(1, metadata.decode_rows),
            key_cache,
            value_cache,
            tables,
            scale,
            sliding_window,
            softcap,
        )
    for span, (block_ids, key_start) in zip(metadata.prefills, tables.prefill_blocks, strict=True):
        rows = slice(span.q_start, span.q_start + span.q_len)
        if block_ids is None:
            span_k, span_v = k[:, rows], v[:, rows]
        else:
            length = span.context_len - key_start
            span_k = key_cache.index_select(1, block_ids).flatten(1, 2)[:, :length]
            span_v = value_cache.index_select(1, block_ids).flatten(1, 2)[:, :length]
        out[:, rows] = _prefill_attention(
            q[:, rows], span_k, span_v, span, scale, sliding_window, softcap, key_start
        )
    return out.transpose(0, 1)


def layer_tables(metadata: AttentionMetadata, layer: int) -> AttentionMetadata | GroupTables:
    """The slot mapping and block tables that layer ``layer`` reads this step."""
    return metadata.groups[metadata.layer_group[layer]] if metadata.groups else metadata


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata | GroupTables,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One query token per request against its gathered blocks, as a grouped matmul.

    ``q`` is ``[heads, seqs, dim]``. With the cache laid out ``[kv_heads, blocks,
    block_size, dim]``, gathering the block tables yields ``[kv_heads, seqs,
    context, dim]`` contiguous, which the batched matmuls read directly (K
    transposed by stride, no copy). Returns ``[heads, seqs, value_dim]``.
    ``metadata`` supplies the decode tables (the step's, or one cache group's).
    """
    assert metadata.decode_block_tables is not None and metadata.decode_padding_mask is not None
    num_heads, num_seqs, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    tables = metadata.decode_block_tables
    width = tables.shape[1] * key_cache.shape[2]
    flat_tables = tables.flatten()
    keys = key_cache.index_select(1, flat_tables).view(num_kv_heads, num_seqs, width, -1)
    values = value_cache.index_select(1, flat_tables).view(num_kv_heads, num_seqs, width, -1)
    q = q.view(num_kv_heads, group, num_seqs, head_dim).transpose(1, 2)  # [kv, seqs, group, dim]
    scores = torch.matmul(q, keys.transpose(2, 3)).float()  # [kv, seqs, group, ctx]
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.add_(metadata.decode_padding_mask)
    if sliding_window is not None:
        assert metadata.decode_context_lens is not None
        positions = torch.arange(width, device=scores.device)
        first_visible = (metadata.decode_context_lens - sliding_window).view(1, -1, 1, 1)
        scores = scores.masked_fill(positions < first_visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [kv, seqs, group, vdim]
    return out.transpose(1, 2).reshape(num_heads, num_seqs, -1)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    key_start: int = 0,
) -> torch.Tensor:
    """``q`` is ``[heads, q_len, dim]``; ``k``/``v`` are ``[kv_heads, context_len - key_start,
    dim]``: the keys of positions ``key_start`` (> 0 only for a window) to ``context_len``."""
    mask = span.mask
    if sliding_window is not None:
        q_pos = torch.arange(span.context_len - span.q_len, span.context_len, device=q.device)
        k_pos = torch.arange(key_start, span.context_len, device=q.device)
        mask = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) & (
            k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - sliding_window
        )
    if softcap is not None:
        return _eager_attention(q, k, v, mask, scale, softcap, span)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[0],
    )
    return out[0]


def _eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    span: PrefillSpan,
) -> torch.Tensor:
    """Explicit softmax attention for the cases SDPA cannot express (logit soft-capping)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(span.q_len, span.context_len, dtype=torch.bool, device=q.device).tril(
            span.context_len - span.q_len
        )
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _probe(
    record: ProbeRecord,
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> tuple[torch.Tensor, None]:
    if id(module) in record.layer_of_module:
        raise NotImplementedError(
            "an attention module ran twice in one forward (shared layers); cbgen does not support it"
        )
    record.layer_of_module[id(module)] = len(record.layers)
    window = int(sliding_window) if sliding_window else None
    record.layers.append(LayerSpec(k.shape[0], k.shape[2], v.shape[2], k.dtype, window))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[0],
    )
    return out.transpose(1, 2), None


def register() -> None:
    """Make ``cbgen_paged`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
