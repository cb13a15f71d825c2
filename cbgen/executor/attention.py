"""Attention backends: the torch reference (every device; the test oracle) and the native
CPU paged kernel.

Both store the step's new K/V in the paged cache, then attend, for every request,
over that request's own cached tokens through its cache group's tables
(``GroupTables``): a sliding-window group's tables start at the first block its
window still reads, with context lengths and key positions shifted to match, so
windowed layers only ever read the window.

* ``NativeCpuAttention``: every row of the step, decode or prefill, is a query over
  its own request's blocks up to its own position, and one kernel call per layer
  attends them all (``cbgen/executor/cpu/kernels/paged_decode.cpp``), for every cache group.
* ``TorchReferenceAttention``: decode rows (one new token per request) go through
  one batched grouped matmul over K/V gathered from the block tables, masked past
  each context; prefill chunks through torch SDPA one request at a time, causal
  within the chunk and over everything cached before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionBackend
from .metadata import AttentionMetadata, GroupTables, PrefillSpan
from .native import NativeKernels


class TorchReferenceAttention(AttentionBackend):
    """Plain torch on any device and dtype: the oracle every fast backend is tested
    against, and what serves where no faster backend does (CUDA today)."""

    name = "torch-reference"
    padding_mask = True

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return None

    def attend(
        self,
        metadata: AttentionMetadata,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        store: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tables = metadata.tables(layer)
        cache = metadata.cache
        if store:
            cache.write(layer, tables.slot_mapping, k, v)
        key_cache, value_cache = cache.keys[layer], cache.values[layer]
        if metadata.decode_only:
            out = self.decode(
                q, key_cache, value_cache, tables, scale, sliding_window, softcap, sinks
            )
            return out.transpose(0, 1)

        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        if metadata.decode_rows is not None:
            out[:, metadata.decode_rows] = self.decode(
                q.index_select(1, metadata.decode_rows),
                key_cache,
                value_cache,
                tables,
                scale,
                sliding_window,
                softcap,
                sinks,
            )
        spans = zip(metadata.prefills, tables.prefill_blocks, strict=True)
        for span, (block_ids, key_start) in spans:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if block_ids is None:
                span_k, span_v = k[:, rows], v[:, rows]
            else:
                length = span.context_len - key_start
                span_k = key_cache.index_select(1, block_ids).flatten(1, 2)[:, :length]
                span_v = value_cache.index_select(1, block_ids).flatten(1, 2)[:, :length]
                span_k, span_v = span_k.to(q.dtype), span_v.to(q.dtype)
            out[:, rows] = prefill_attention(
                q[:, rows], span_k, span_v, span, scale, sliding_window, softcap, key_start, sinks
            )
        return out.transpose(0, 1)

    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: GroupTables,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return decode_attention(
            q, key_cache, value_cache, tables, scale, sliding_window, softcap, sinks
        )


class NativeCpuAttention(AttentionBackend):
    """The native paged kernel: K/V read straight from the block tables, no gathered copy,
    exact two-pass float32 softmax; windows and soft-capping included."""

    name = "native-cpu-paged"
    row_tables = True

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        reason = self.kernels.refusal(device, "paged_decode_attention")
        if reason is not None:
            return reason
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return f"the paged kernel reads float caches and the model is {dtype}"
        module = self.kernels.module()
        assert module is not None
        self._kernel = module.paged_decode_attention
        return None

    def attend(
        self,
        metadata: AttentionMetadata,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        store: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache = metadata.cache
        if store:
            cache.write(layer, metadata.tables(layer).slot_mapping, k, v)
        return self._run(
            q,
            cache.keys[layer],
            cache.values[layer],
            *_row_tables(metadata, layer),
            scale,
            sliding_window,
            softcap,
            sinks,
        )

    def attend_stored(
        self,
        metadata: AttentionMetadata,
        layer: int,
        q: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``attend`` for a caller that stored the layer's new K/V itself (the fast
        decoder's ``rope_qkv``), with ``q`` ``[tokens, heads, dim]`` as that op returns
        it; returns ``[tokens, heads, value_dim]`` in ``q``'s dtype. One kernel call and
        no K/V views: on a single stream of SmolLM2 int4 (30 layers) the general call's
        views, transposes and frames had cost about half a millisecond a step (9.29 ->
        8.71 ms, an interleaved A/B on the AVX2 EPYC)."""
        cache = metadata.cache
        keys = cache.keys[layer]
        if q.dtype is keys.dtype and q.is_contiguous():
            # The kernel's own layout and dtype already: no views or conversions around it
            # (five calls a layer; on one SmolLM2 int4 stream this method's 30 calls a
            # step went from 1.45 to 0.72 ms under cProfile).
            return self._kernel(
                q,
                keys,
                cache.values[layer],
                *_row_tables(metadata, layer),
                scale,
                sliding_window or 0,
                softcap or 0.0,
                None,
            )
        return self._run(
            q.transpose(0, 1),  # _run's [heads, tokens, dim]: a view it transposes back
            keys,
            cache.values[layer],
            *_row_tables(metadata, layer),
            scale,
            sliding_window,
            softcap,
        )

    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: GroupTables,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = self._run(
            q,
            key_cache,
            value_cache,
            tables.decode_block_tables,
            tables.decode_context_lens,
            scale,
            sliding_window,
            softcap,
            sinks,
        )
        return out.transpose(0, 1)

    def _run(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor | None,
        context_lens: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel on ``q`` ``[heads, rows, dim]``; returns ``[rows, heads, value_dim]``
        in ``q``'s dtype. The kernel reads queries in the cache's dtype, which
        ``kv_cache_dtype`` may have made another than the model's."""
        out = self._kernel(
            q.transpose(0, 1).to(key_cache.dtype).contiguous(),
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            None if sinks is None else sinks.detach().float().contiguous(),
        )
        return out.to(q.dtype)


def _row_tables(
    metadata: AttentionMetadata, layer: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The block tables and context lengths the native kernel reads for ``layer``: the
    decode tables when every row is a decode, else one table per row (the builder gives
    every row one when the step has prefill rows)."""
    return metadata.tables(layer).row_tables(metadata.decode_only)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: GroupTables,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request against its gathered blocks, as a grouped matmul.

    ``q`` is ``[heads, seqs, dim]``. With the cache laid out ``[kv_heads, blocks,
    block_size, dim]``, gathering the block tables yields ``[kv_heads, seqs,
    context, dim]`` contiguous, which the batched matmuls read directly (K
    transposed by stride, no copy). Returns ``[heads, seqs, value_dim]``.
    ``tables`` supplies the decode tables and padding mask of one cache group.
    """
    assert tables.decode_block_tables is not None and tables.decode_padding_mask is not None
    num_heads, num_seqs, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    block_tables = tables.decode_block_tables
    width = block_tables.shape[1] * key_cache.shape[2]
    flat_tables = block_tables.flatten()
    keys = key_cache.index_select(1, flat_tables).view(num_kv_heads, num_seqs, width, -1)
    values = value_cache.index_select(1, flat_tables).view(num_kv_heads, num_seqs, width, -1)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a cache of another dtype
    q = q.view(num_kv_heads, group, num_seqs, head_dim).transpose(1, 2)  # [kv, seqs, group, dim]
    scores = torch.matmul(q, keys.transpose(2, 3)).float()  # [kv, seqs, group, ctx]
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.add_(tables.decode_padding_mask)
    if sliding_window is not None:
        assert tables.decode_context_lens is not None
        positions = torch.arange(width, device=scores.device)
        first_visible = (tables.decode_context_lens - sliding_window).view(1, -1, 1, 1)
        scores = scores.masked_fill(positions < first_visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
    else:
        sink = sinks.float().view(num_kv_heads, 1, group, 1).expand(-1, num_seqs, -1, 1)
        probs = _softmax_with_sink(scores, sink).to(values.dtype)
    out = torch.matmul(probs, values)  # [kv, seqs, group, vdim]
    return out.transpose(1, 2).reshape(num_heads, num_seqs, -1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    key_start: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` is ``[heads, q_len, dim]``; ``k``/``v`` are ``[kv_heads, context_len - key_start,
    dim]``: the keys of positions ``key_start`` (> 0 only for a window) to ``context_len``.
    ``sinks``: one extra logit per head in the softmax (``[heads]``)."""
    mask = span.mask
    if sliding_window is not None:
        q_pos = torch.arange(span.context_len - span.q_len, span.context_len, device=q.device)
        k_pos = torch.arange(key_start, span.context_len, device=q.device)
        mask = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) & (
            k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - sliding_window
        )
    if softcap is not None or sinks is not None:
        return _eager_attention(q, k, v, mask, scale, softcap, span, sinks)
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
    softcap: float | None,
    span: PrefillSpan,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit softmax attention for the cases SDPA cannot express (logit soft-capping,
    attention sinks)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(span.q_len, span.context_len, dtype=torch.bool, device=q.device).tril(
            span.context_len - span.q_len
        )
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_with_sink(scores, sinks.float().view(-1, 1, 1).expand(-1, span.q_len, 1))
    return torch.matmul(probs.to(v.dtype), v)


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over ``scores`` and one more logit (``sink``, the last dim of size 1) that
    takes its share of the weight and is then dropped, as transformers' eager GPT-OSS
    attention computes it."""
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]
