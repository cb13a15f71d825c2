"""Cache groups: attention layers that share one block list per request.

The probe forward records, for every attention layer, the ``sliding_window`` its
module passes to the attention function (``LayerSpec.sliding_window``). Layers
are grouped by that attention kind:

* ``FULL``: the layer attends to every earlier token, so a request keeps all of
  its blocks;
* ``SLIDING_WINDOW`` of ``W``: a query at position ``p`` sees keys ``p - W + 1 ..
  p``, so a request keeps only the blocks from ``(start - W + 1) // block_size``
  on (``start``: its first token not yet computed) and gives the older ones back
  to the free list while it runs. A decoding request holds at most
  ``ceil((W - 1) / block_size) + 1`` blocks per windowed group.

All groups draw from one ``BlockAllocator`` pool. A block id belongs to one
group of one request at a time, so the ``j``-th layer of every group can share
one physical K/V tensor (``tensor_layout``): a block costs the bytes of the
largest group's layers, not of all layers. To keep that cost close to what the
layers actually use, a model with several kinds splits every kind into groups of
``min(layers per kind)`` layers (Gemma 3 270M: 3 full-attention layers and 15
sliding ones become one full group and five windowed groups of three layers,
vLLM's hybrid-allocator layout).

Layers that keep a fixed-size per-request state instead of K/V (Mamba mixers, linear
attention, short convolutions) are not a group: a request holds one state slot for all
of them at once, whatever its length (``cbgen.cache.state``), taken at admission and
given back at its finish or preemption by the ``KVCacheManager``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer stores per token, as observed by running the model.

    ``sliding_window`` is the window the layer's module passed to the attention
    function (None: full attention); it decides the layer's cache group.
    """

    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.key_dim + self.value_dim) * itemsize


class AttentionKind(str, enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CacheGroup:
    """Layers (probe indices) with one attention kind and one block list per request."""

    index: int
    kind: AttentionKind
    layers: tuple[int, ...]
    window: int | None = None  # for SLIDING_WINDOW: how many tokens a query sees, itself included

    @property
    def is_windowed(self) -> bool:
        return self.window is not None

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block that queries at positions ``>= start`` still read."""
        if self.window is None:
            return 0
        return max(0, start - self.window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once in this group.

        A chunk ``[s, s + n)`` of a windowed group needs the blocks of positions
        ``s - W + 1 .. s + n - 1``: at most ``ceil((W + n - 2) / block_size) + 1``.
        """
        total = -(-num_tokens // block_size)
        if self.window is None:
            return total
        return min(total, -(-(self.window + max_chunk - 2) // block_size) + 1)

    def describe(self) -> str:
        kind = f"window {self.window}" if self.window is not None else "full"
        return f"{kind}: layers {list(self.layers)}"


FULL_GROUP = CacheGroup(0, AttentionKind.FULL, ())


def build_groups(layers: Sequence[LayerSpec]) -> list[CacheGroup]:
    """Group layers by attention kind: full attention first, then windows, smallest first.

    With more than one kind, every kind is cut into groups of ``min(layers per
    kind)`` consecutive layers (the last one may be smaller) so that groups sized
    alike can share physical tensors (see the module docstring).
    """
    if not layers:
        return [FULL_GROUP]
    by_window: dict[int | None, list[int]] = {}
    for index, spec in enumerate(layers):
        by_window.setdefault(spec.sliding_window, []).append(index)
    windows = sorted(by_window, key=lambda w: (w is not None, w or 0))
    size = min(len(by_window[w]) for w in windows) if len(windows) > 1 else len(layers)
    groups: list[CacheGroup] = []
    for window in windows:
        members = by_window[window]
        kind = AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW
        for start in range(0, len(members), size):
            chunk = tuple(members[start : start + size])
            groups.append(CacheGroup(len(groups), kind, chunk, window))
    return groups


def _shape_key(spec: LayerSpec) -> tuple:
    return (spec.num_kv_heads, spec.key_dim, spec.value_dim, spec.dtype)


def tensor_layout(
    layers: Sequence[LayerSpec], groups: Sequence[CacheGroup] | None
) -> tuple[list[int], list[LayerSpec]]:
    """Which physical K/V tensor each layer uses, and the specs of those tensors.

    Layers of different groups share a tensor when their shapes match (a block
    id is only ever used by one group at a time); layers of one group never do.
    Without groups (or with one) every layer has its own tensor.
    """
    if not groups or len(groups) <= 1:
        return list(range(len(layers))), list(layers)
    tensor_of_layer = [-1] * len(layers)
    tensors: list[LayerSpec] = []
    for group in groups:
        taken: set[int] = set()
        for layer in group.layers:
            key = _shape_key(layers[layer])
            slot = next(
                (t for t, spec in enumerate(tensors) if t not in taken and _shape_key(spec) == key),
                None,
            )
            if slot is None:
                slot = len(tensors)
                tensors.append(layers[layer])
            taken.add(slot)
            tensor_of_layer[layer] = slot
    assert all(t >= 0 for t in tensor_of_layer), "a layer is in no cache group"
    return tensor_of_layer, tensors


def max_request_tokens(
    groups: Sequence[CacheGroup], num_blocks: int, block_size: int, max_chunk: int
) -> int | None:
    """The longest request that fits alone in ``num_blocks`` (None: any length fits).

    Only full-attention groups grow without bound; windowed groups stop at their
    window. Returns 0 when not even a one-token request fits.
    """

    def need(tokens: int) -> int:
        return sum(g.max_blocks(tokens, block_size, max_chunk) for g in groups)

    if not any(g.window is None for g in groups) and need(1 << 40) <= num_blocks:
        return None  # windowed groups only: the blocks held stop growing at the window
    low, high = 0, num_blocks * block_size  # need(low) fits; search the largest that does
    if need(high) <= num_blocks:
        return high
    while low + 1 < high:
        mid = (low + high) // 2
        if need(mid) <= num_blocks:
            low = mid
        else:
            high = mid
    return low
