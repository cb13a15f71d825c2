"""A step's attention inputs, in one shape for one or many cache groups.

Every layer reads its cache group's ``GroupTables`` (``AttentionMetadata.tables``):
a model with one group has a list of one. The tables a backend does not read
(``AttentionBackend.row_tables`` / ``padding_mask``) are left ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.groups import LayerSpec
from ..cache.paged_cache import PagedKVCache
from ..cache.state import StateCache, StateSpec

if TYPE_CHECKING:
    from .base import AttentionBackend


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

    A windowed group's tables start at the first block in the window:
    ``decode_context_lens`` and ``row_context_lens`` count tokens from that block's
    first position. ``prefill_blocks`` has, per prefill span, the blocks holding its
    keys from position ``key_start`` to ``context_len`` (``None``: a fresh chunk, whose
    keys are its own) and that ``key_start``.

    ``row_block_tables`` / ``row_context_lens`` (``[tokens, width]``, ``[tokens]``), for
    a backend with ``row_tables`` in a step with prefill rows: each row of the step is a
    query of its own over its request's cache up to its position, so one kernel call
    attends every row. A 450-token chunk took 2.2 ms a layer that way against 3.6 ms in
    SDPA, which also wanted the cached keys gathered.
    """

    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token
    decode_block_tables: torch.Tensor | None = None  # [decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [decodes]
    decode_padding_mask: torch.Tensor | None = None  # [1, decodes, 1, max_blocks*block_size]
    prefill_blocks: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None

    def row_tables(self, decode_only: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The block tables and context lengths a row-table kernel reads: the decode
        tables when every row is a decode, else one table per row."""
        if decode_only:
            return self.decode_block_tables, self.decode_context_lens
        return self.row_block_tables, self.row_context_lens


@dataclass(frozen=True)
class SlotSet:
    """The state slots one call reads and writes: their ids, and the first of them when
    they are consecutive (then the states are read and written in place, through views,
    instead of gathered and scattered: a Falcon-H1-shaped request keeps 3 MiB)."""

    ids: torch.Tensor
    first: int | None = None

    @classmethod
    def of(cls, slots: Sequence[int], device: torch.device) -> SlotSet:
        first = slots[0] if list(slots) == list(range(slots[0], slots[0] + len(slots))) else None
        return cls(torch.tensor(list(slots), dtype=torch.long, device=device), first)

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass(frozen=True)
class StateChunk:
    """A chunk of one request's rows that a state layer runs on its own (not with the
    single-token rows).

    ``continues``: the request's state goes on from its slot (a chunk at position 0
    starts from zeros). ``replay``: its rows from there on hold tokens the request
    generated before a preemption; they run one at a time, as they first did, so the
    recomputed state is the one decoding made (a chunked scan rounds differently from a
    recurrence). ``load``: a prefix-cache hit, whose state is first copied from that
    checkpoint slot. ``save_at`` / ``save_slot``: after that many rows, the state is
    copied to that checkpoint slot (a block boundary of the prompt). ``slots``: the
    request's slot as every layer's calls take it, built once for the step.
    """

    row: int
    count: int
    slot: int
    slots: SlotSet
    continues: bool
    replay: int
    load: int = -1
    save_at: int = 0
    save_slot: int = -1


@dataclass
class StateSegments:
    """Which rows of a step continue which request's state (``cbgen.executor.state_mixers``).

    ``decode_rows`` / ``decode_slots``: the single-token chunks that continue a state,
    run together in one call (``decode_only``: they are every row of the step, in
    order). ``chunks``: every other chunk, one call each (or more: see ``StateChunk``).
    """

    cache: StateCache
    decode_rows: torch.Tensor | None = None
    decode_slots: SlotSet | None = None
    decode_only: bool = False
    chunks: list[StateChunk] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """A step's attention inputs: the rows' roles, and one ``GroupTables`` per cache group
    (``layer_group`` maps each layer to its group). ``backend`` attends."""

    cache: PagedKVCache
    layer_of_module: dict[int, int]
    groups: list[GroupTables]
    layer_group: Sequence[int]  # layer -> index into groups
    backend: AttentionBackend
    decode_rows: torch.Tensor | None = None  # [decodes] row of each decode token in the batch
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_only: bool = False  # every row is a decode row, in order: no gather/scatter of q
    state: StateSegments | None = None  # the rows' state slots, for models with state layers

    def tables(self, layer: int) -> GroupTables:
        """The slot mapping and block tables that layer ``layer`` reads this step."""
        return self.groups[self.layer_group[layer]]


@dataclass
class ProbeRecord:
    """Filled by a probe forward: one ``LayerSpec`` per attention module, in call order.

    Each spec holds what the layer's attention call showed: K/V heads and head sizes
    (from the tensors), dtype, and the ``sliding_window`` the module passed.
    ``softcaps``: the logit soft-capping a layer passed (Gemma 2), by layer; the cache
    does not depend on it, the fast decoder passes it on.
    ``state_layers``: what each state-keeping layer keeps per request.
    """

    layer_of_module: dict[int, int] = field(default_factory=dict)
    layers: list[LayerSpec] = field(default_factory=list)
    softcaps: dict[int, float] = field(default_factory=dict)
    # The layers that keep a per-request state instead of K/V (``StateMixers``' order).
    state_layers: list[StateSpec] = field(default_factory=list)
