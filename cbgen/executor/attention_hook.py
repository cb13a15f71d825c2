"""Paged attention, plugged into transformers through its ``AttentionInterface``.

The model runs once per step over all scheduled tokens packed into a single
sequence (batch dimension 1). Each attention layer calls ``paged_attention``,
which hands the layer's tensors to the step's attention backend
(``cbgen.executor.attention``: the native CPU kernel or the torch reference,
chosen once when the engine is built); the backend stores the step's new K/V in
the paged cache and attends, for every request, over that request's own cached
tokens, through the tables of the layer's cache group.

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
from typing import Any

import torch
import torch.nn.functional as F

from ..cache.groups import LayerSpec
from .attention import decode_attention as _decode_attention
from .attention import prefill_attention as _prefill_attention
from .metadata import AttentionMetadata, GroupTables, PrefillSpan, ProbeRecord

__all__ = [
    "ATTENTION_NAME",
    "AttentionMetadata",
    "GroupTables",
    "PrefillSpan",
    "ProbeRecord",
    "_decode_attention",
    "_prefill_attention",
    "attend",
    "attention_context",
    "layer_tables",
    "paged_attention",
    "register",
]

ATTENTION_NAME = "cbgen_paged"


_state = threading.local()


@contextmanager
def attention_context(metadata: AttentionMetadata | ProbeRecord) -> Iterator[None]:
    previous = getattr(_state, "metadata", None)
    _state.metadata = metadata
    try:
        yield
    finally:
        _state.metadata = previous


def current_metadata() -> AttentionMetadata | ProbeRecord | None:
    """The step's metadata (or the probe's record) installed on this thread, if any."""
    return getattr(_state, "metadata", None)


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
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks: one logit per head
    if query.shape[0] != 1:
        raise RuntimeError(f"cbgen packs every step into batch size 1, got {query.shape[0]}")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])

    # Head-major throughout, as transformers hands the tensors over: no transposes.
    q, k, v = query[0], key[0], value[0]  # [heads, tokens, dim], [kv_heads, tokens, dim]

    if isinstance(metadata, ProbeRecord):
        return _probe(metadata, module, q, k, v, scale, sliding_window, softcap)

    out = metadata.backend.attend(
        metadata,
        metadata.layer_of_module[id(module)],
        q,
        k,
        v,
        scale,
        sliding_window,
        softcap,
        sinks=sinks,
    )
    # Contiguous, as transformers' own attention functions return it: some model code
    # views the result (JetMoE), which a transposed tensor cannot take.
    return out.contiguous().unsqueeze(0), None


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
    did: ``store=False``), then attend, with the step's attention backend.

    ``q`` is ``[heads, tokens, dim]``, ``k``/``v`` ``[kv_heads, tokens, dim]`` (views
    of any layout). Returns ``[tokens, heads, value_dim]``.
    """
    return metadata.backend.attend(metadata, layer, q, k, v, scale, sliding_window, softcap, store)


def layer_tables(metadata: AttentionMetadata, layer: int) -> GroupTables:
    """The slot mapping and block tables that layer ``layer`` reads this step."""
    return metadata.tables(layer)


def _probe(
    record: ProbeRecord,
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, None]:
    if id(module) in record.layer_of_module:
        raise NotImplementedError(
            "an attention module ran twice in one forward (shared layers); cbgen does not support it"
        )
    record.layer_of_module[id(module)] = len(record.layers)
    window = int(sliding_window) if sliding_window else None
    record.layers.append(LayerSpec(k.shape[0], k.shape[2], v.shape[2], k.dtype, window))
    if softcap:
        record.softcaps[len(record.layers) - 1] = float(softcap)
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
