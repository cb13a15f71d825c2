"""Per-request state slots: the cache of layers that keep a fixed-size state, not K/V.

Mamba and Mamba2 mixers, gated-delta-rule (linear attention) layers and short
convolutions keep, per request, a convolution window and/or a recurrent state whose
size does not grow with the sequence. Each such layer (``StateSpec``, found by the
executor's probe running the model) gets, per state tensor, one tensor of
``[num_slots, *shape]``; a request holds one slot index for every state layer at once
(``StateSlotPool``), taken when it is admitted and given back when it finishes or is
preempted (recompute: the next run computes the state from the prompt again).

A slot is never read before its request's first chunk has written it: a chunk that
starts at position 0 computes its state from zeros, so a slot handed over from a
finished request needs no clearing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .paged_cache import _zeros, commit_tensors


@dataclass(frozen=True)
class StateTensorSpec:
    """One state tensor of a layer: its kind in transformers' cache layer ("conv" or
    "recurrent"), its index there (``state_idx``), its shape per request and dtype."""

    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    conv_kernel: int | None = None  # for "conv": the window the layer keeps

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """What one state layer keeps per request, as the probe saw it.

    ``layer_idx`` is the module's own ``layer_idx`` (its index in transformers'
    ``Cache``); ``module`` its class name, for logs and errors.
    """

    layer_idx: int
    module: str
    tensors: tuple[StateTensorSpec, ...]

    @property
    def bytes_per_request(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        parts = ", ".join(
            f"{t.kind}[{t.index}] {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for t in self.tensors
        )
        return f"layer {self.layer_idx} ({self.module}): {parts}"


def state_bytes_per_request(specs: Sequence[StateSpec]) -> int:
    return sum(spec.bytes_per_request for spec in specs)


class StateSlotPool:
    """Slot indices of the state cache, handed out one per running request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                "no free state slot: more requests run than max_num_seqs (a scheduler bug)"
            )
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not in use")
        self._free.append(slot)


class StateCache:
    """Every state layer's tensors, ``[num_slots, *shape]`` each (``tensors[i][j]``: layer
    ``specs[i]``, tensor ``specs[i].tensors[j]``). Host pages are committed as slots are
    first written, as for the K/V blocks."""

    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: torch.device) -> None:
        self.specs = list(specs)
        self.num_slots = num_slots
        self.device = device
        self.tensors: list[list[torch.Tensor]] = [
            [_zeros((num_slots, *t.shape), t.dtype, device) for t in spec.tensors]
            for spec in self.specs
        ]

    def commit(self) -> int:
        """Write every slot now (see ``PagedKVCache.commit``); returns the bytes written."""
        return commit_tensors([t for layer in self.tensors for t in layer])


class StateCheckpoints:
    """States at cached prefix boundaries, so a prefix-cache hit can start a state model
    past the cached blocks.

    A checkpoint is one more slot of the ``StateCache`` (ids from ``first_slot`` on)
    holding every state layer's state right after a block of some request's prompt: the
    KV-cache manager plans one for the last prompt block boundary each prefill chunk
    reaches (``KVCacheManager.plan_checkpoint``), the executor copies the request's slot there at that row, and the
    checkpoint joins the lookup (``by_hash``, least recently used first) when the block
    itself is registered in the prefix cache, after its step. A hit is usable up to the
    last of its blocks that has one. Checkpoints a step reads are pinned while it is
    planned, so no save in the same step can take their slot.
    """

    def __init__(self, num_slots: int, first_slot: int) -> None:
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[object, int] = OrderedDict()  # registered, LRU first
        self.pinned: set[int] = set()

    def lookup(self, block_hash: object) -> int | None:
        return self.by_hash.get(block_hash)

    def use(self, block_hash: object) -> int:
        """The checkpoint of ``block_hash``, marked most recently used and pinned."""
        self.by_hash.move_to_end(block_hash)
        slot = self.by_hash[block_hash]
        self.pinned.add(slot)
        return slot

    def take(self) -> int | None:
        """A slot for a new checkpoint: a free one, else the least recently used one that
        no request of this step reads (None: every one is pinned)."""
        if self._free:
            return self._free.pop()
        for block_hash, slot in self.by_hash.items():
            if slot not in self.pinned:
                del self.by_hash[block_hash]
                return slot
        return None

    def register(self, block_hash: object, slot: int) -> None:
        """The checkpoint in ``slot`` holds the state after the block ``block_hash``."""
        if block_hash in self.by_hash:
            self.release(slot)  # one already: keep it, give this slot back
        else:
            self.by_hash[block_hash] = slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def reset(self) -> None:
        """Forget every registered checkpoint (the prefix cache was emptied)."""
        self._free.extend(self.by_hash.values())
        self.by_hash.clear()
