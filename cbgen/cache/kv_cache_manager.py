"""The one owner of every request's KV blocks: tables per cache group, prefix cache, swap.

The scheduler decides *who* runs and *how many* tokens each gets; this module decides
*which blocks* hold them. It keeps, per running request, one block list per cache
group (full attention, sliding window; ``-1`` marks a block dropped from a window),
takes cached prefix blocks at admission and registers computed ones, drops blocks a
window no longer reads, copies preempted requests' blocks to a host swap space and
back, and rolls a request back to fewer tokens (rejected speculative tokens). Its
only writes to a ``Request`` are the cached chain hashes of its full blocks
(``block_hashes``), which depend on the tokens alone.

A model with state layers (Mamba-style mixers, linear attention, short convolutions)
also gets one state slot per running request (``state_slots``, ``cbgen.cache.state``):
taken at admission with the first blocks, given back with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..requests.request import Request
from ..requests.scheduler_output import BlockMove
from .allocator import BlockAllocator
from .groups import FULL_GROUP, CacheGroup
from .prefix_cache import BlockHash, extend_block_hashes
from .state import StateCheckpoints, StateSlotPool


@dataclass
class InFlightBlocks:
    """Hashes of the full blocks the step being planned computes, so a second request with
    the same prefix waits a step and reuses them instead of computing them twice."""

    hashes: set[BlockHash] = field(default_factory=set)
    num_seen: int = 0  # chunks of the step already folded into ``hashes``


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of every cache group, the prefix cache and the swap space.

    ``allocator`` hands out device blocks (shared by all groups). Prefix caching needs
    a single full-attention group and is switched off otherwise. ``swap_blocks > 0``
    gives a host swap space of that many blocks (``host_allocator``).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        groups: Sequence[CacheGroup] | None = None,
        *,
        enable_prefix_caching: bool = True,
        swap_blocks: int = 0,
        state_slots: int = 0,
        state_checkpoints: int = 0,
    ) -> None:
        self.allocator = allocator
        # One state slot per running request when the model has state layers.
        self.state_slots = StateSlotPool(state_slots) if state_slots > 0 else None
        self._state_slot: dict[Request, int] = {}
        # States at cached block boundaries (slots after the running ones), for hits.
        self.checkpoints = (
            StateCheckpoints(state_checkpoints, state_slots)
            if state_slots > 0 and state_checkpoints > 0 and enable_prefix_caching
            else None
        )
        self._state_load: dict[Request, int] = {}  # checkpoint a hit starts from
        # Checkpoints planned, not yet registered: (block index, block hash, slot).
        self._pending_checkpoints: dict[Request, list[tuple[int, BlockHash, int]]] = {}
        self.block_size = block_size
        self.groups: tuple[CacheGroup, ...] = tuple(groups) if groups else (FULL_GROUP,)
        self._windowed = [i for i, g in enumerate(self.groups) if g.is_windowed]
        single_full = len(self.groups) == 1 and not self._windowed
        self.enable_prefix_caching = enable_prefix_caching and single_full
        self._tables: dict[Request, list[list[int]]] = {}
        self._num_cached_blocks: dict[Request, int] = {}  # leading blocks in the prefix cache
        self.host_allocator = BlockAllocator(swap_blocks) if swap_blocks > 0 else None
        self._host_tables: dict[Request, list[list[int]]] = {}
        # Host blocks of last step's swap-ins: freed only once those copies have run.
        self._host_blocks_in_use: list[int] = []

    # -- queries ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def has_windows(self) -> bool:
        return bool(self._windowed)

    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's block list of every cache group (empty lists when it holds none)."""
        tables = self._tables.get(request)
        return tables if tables is not None else [[] for _ in self.groups]

    def block_ids(self, request: Request) -> list[int]:
        """The request's blocks of the first cache group."""
        tables = self._tables.get(request)
        return tables[0] if tables is not None else []

    def state_slot(self, request: Request) -> int:
        """The request's state slot (-1: none, or the model keeps no state)."""
        return self._state_slot.get(request, -1)

    def num_cached_blocks(self, request: Request) -> int:
        return self._num_cached_blocks.get(request, 0)

    def host_block_count(self) -> int:
        """Host blocks held: by swapped requests, and by last step's swap-ins."""
        held = sum(b >= 0 for tables in self._host_tables.values() for t in tables for b in t)
        return held + len(self._host_blocks_in_use)

    def blocks_for_first_chunk(self, num_tokens: int) -> int:
        """Blocks, over all groups, that a new request's first ``num_tokens`` take."""
        return _ceil_div(num_tokens, self.block_size) * len(self.groups)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks ``request`` needs to hold ``num_tokens`` more tokens."""
        total = _ceil_div(request.num_computed_tokens + num_tokens, self.block_size)
        return sum(max(0, total - len(blocks)) for blocks in self.block_tables(request))

    def blocks_to_finish(self, request: Request) -> int:
        """Blocks ``request`` may still take: up to its prompt plus ``max_new_tokens``."""
        remaining = _final_length(request) - request.num_computed_tokens
        return self.blocks_needed(request, max(0, remaining))

    def admission_cost(self, request: Request, hits: list[int], num_tokens: int) -> int:
        """Free blocks that admitting ``request`` with ``hits`` cached and ``num_tokens``
        to compute uses: new blocks, plus evictable cached blocks it revives."""
        total = _ceil_div(len(hits) * self.block_size + num_tokens, self.block_size)
        needed = total - len(hits) + total * (len(self.groups) - 1)
        revived = sum(1 for block in hits if self.allocator.ref_count(block) == 0)
        return needed + revived

    def growth_after(self, request: Request, num_cached: int, num_tokens: int) -> int:
        """Blocks ``request`` takes past its first chunk, up to its final length."""
        total = _ceil_div(num_cached + num_tokens, self.block_size)
        return max(0, self._final_blocks(request) - total) * len(self.groups)

    # -- allocation -------------------------------------------------------------------

    def admit(self, request: Request, hits: list[int], num_tokens: int) -> None:
        """Give a new request the cached blocks ``hits`` (shared) and fresh blocks for
        ``num_tokens`` more tokens in every group."""
        bs = self.block_size
        total = _ceil_div(len(hits) * bs + num_tokens, bs)
        final = self._final_blocks(request)
        self.allocator.share(hits)
        first = hits + self.allocator.allocate(
            total - len(hits), after=hits[-1] if hits else None, region=final - len(hits)
        )
        self._tables[request] = [first] + [self.allocator.allocate(total) for _ in self.groups[1:]]
        self._num_cached_blocks[request] = len(hits)
        self._take_state_slot(request)
        if hits and self.checkpoints is not None:
            self._state_load[request] = self.checkpoints.use(request.block_hashes[len(hits) - 1])

    def _take_state_slot(self, request: Request) -> None:
        if self.state_slots is not None and request not in self._state_slot:
            self._state_slot[request] = self.state_slots.allocate()

    def allocate_slots(self, request: Request, num_tokens: int) -> None:
        """Give every group of ``request`` the blocks for ``num_tokens`` more tokens (the
        caller checked ``blocks_needed`` against ``num_free``)."""
        total = _ceil_div(request.num_computed_tokens + num_tokens, self.block_size)
        final = self._final_blocks(request)
        for blocks in self.block_tables(request):
            if total > len(blocks):
                blocks.extend(
                    self.allocator.allocate(
                        total - len(blocks),
                        after=blocks[-1] if blocks else None,
                        region=final - len(blocks),
                    )
                )

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Keep blocks for the first ``num_tokens`` tokens of ``request`` only (the K/V of
        rejected speculative tokens): the blocks past them go back, and a block kept but
        rewritten later is never in the prefix cache (only computed, accepted tokens are
        registered, by ``register_computed``)."""
        keep = _ceil_div(num_tokens, self.block_size)
        if request in self._num_cached_blocks:
            cached = self._num_cached_blocks[request]
            self._num_cached_blocks[request] = min(cached, num_tokens // self.block_size)
        for blocks in self.block_tables(request):
            if len(blocks) > keep:
                self.allocator.free(b for b in reversed(blocks[keep:]) if b >= 0)
                del blocks[keep:]

    def free(self, request: Request) -> None:
        """Give back every block (and the state slot) of ``request``, registering its
        computed blocks first."""
        slot = self._state_slot.pop(request, None)
        if slot is not None:
            assert self.state_slots is not None
            self.state_slots.free(slot)
        self._state_load.pop(request, None)
        tables = self._tables.pop(request, None)
        if tables is not None and self.enable_prefix_caching:
            self._register(request, tables[0])
        for _, _, checkpoint in self._pending_checkpoints.pop(request, []):
            assert self.checkpoints is not None
            self.checkpoints.release(checkpoint)  # its block was never computed
        if tables is None:
            return
        for blocks in tables:
            # Last block first: the tail of a prefix is evicted before its head.
            self.allocator.free(b for b in reversed(blocks) if b >= 0)
        self._num_cached_blocks.pop(request, None)

    def drop_out_of_window(self, request: Request) -> None:
        """Free the blocks of windowed groups that no future query of ``request`` reads."""
        tables = self._tables.get(request)
        if tables is None:
            return
        for index in self._windowed:
            blocks = tables[index]
            first = self.groups[index].first_needed_block(
                request.num_computed_tokens, self.block_size
            )
            stale = []
            for i in range(min(first, len(blocks)) - 1, -1, -1):
                if blocks[i] < 0:
                    break  # everything before was dropped at an earlier step
                stale.append(blocks[i])
                blocks[i] = -1
            if stale:
                self.allocator.free(stale)

    # -- prefix cache -----------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks of the request's prefix, at most ``num_tokens - 1`` tokens' worth:
        the last token is always computed (its logits are sampled) in a block of its own,
        so a shared block is never written. A request whose prompt tokens are still to be
        scored (``prompt_logprobs``) computes its whole prompt."""
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(
            request.block_hashes, request.token_ids, self.block_size, limit, request.cache_salt
        )
        scored = request.prompt_logprobs
        if scored is not None and len(scored) < request.num_prompt_tokens:
            return []
        hits = self.allocator.lookup(hashes[:limit])
        if self.state_slots is not None:
            # A state model starts past a hit only from a checkpoint of its last block.
            checkpoints = self.checkpoints
            count = len(hits)
            while count and (checkpoints is None or checkpoints.lookup(hashes[count - 1]) is None):
                count -= 1
            hits = hits[:count]
        return hits

    def register_computed(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        tables = self._tables.get(request)
        if self.enable_prefix_caching and tables is not None:
            self._register(request, tables[0])

    def _register(self, request: Request, blocks: list[int]) -> None:
        done = self._num_cached_blocks.get(request, 0)
        full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if full <= done:
            return
        hashes = extend_block_hashes(
            request.block_hashes, request.token_ids, self.block_size, full, request.cache_salt
        )
        for index in range(done, full):
            self.allocator.cache_block(blocks[index], hashes[index])
        self._num_cached_blocks[request] = full
        pending = self._pending_checkpoints.get(request)
        if pending:
            assert self.checkpoints is not None
            for _, block_hash, checkpoint in [p for p in pending if p[0] < full]:
                self.checkpoints.register(block_hash, checkpoint)
            self._pending_checkpoints[request] = [p for p in pending if p[0] >= full]

    def next_block_in_flight(
        self,
        request: Request,
        num_hits: int,
        in_flight: InFlightBlocks,
        chunks: Sequence[tuple[Request, int, int]],
    ) -> bool:
        """Whether the block after ``request``'s ``num_hits`` cached ones is computed by
        one of ``chunks`` (``(request, start, num_tokens)`` of the step being planned)."""
        if (
            not self.enable_prefix_caching
            or num_hits >= (request.num_tokens - 1) // self.block_size
        ):
            return False
        next_hash = request.block_hashes[num_hits]
        bs = self.block_size
        while in_flight.num_seen < len(chunks):
            other, start, count = chunks[in_flight.num_seen]
            in_flight.num_seen += 1
            first = start // bs
            # Never hash a placeholder (async scheduling): only known tokens.
            known = other.num_tokens if other.pending_index is None else other.pending_index
            last = min(_ceil_div(start + count, bs), known // bs)
            if last > first:
                hashes = extend_block_hashes(
                    other.block_hashes, other.token_ids, bs, last, other.cache_salt
                )
                in_flight.hashes.update(hashes[first:last])
        return next_hash in in_flight.hashes

    # -- swap -------------------------------------------------------------------------

    def swap_out(self, request: Request) -> BlockMove | None:
        """Copy targets in the swap space for ``request``'s computed blocks; None when
        there is no swap space, nothing computed, or too little room. The device blocks
        stay the request's until ``free``."""
        host = self.host_allocator
        if host is None or request.num_computed_tokens == 0:
            return None
        computed = _ceil_div(request.num_computed_tokens, self.block_size)
        tables = [table[:computed] for table in self.block_tables(request)]
        device_blocks = [b for table in tables for b in table if b >= 0]
        if len(device_blocks) > host.num_free:
            return None
        host_blocks = host.allocate(len(device_blocks))
        take = iter(host_blocks)
        self._host_tables[request] = [
            [next(take) if b >= 0 else -1 for b in table] for table in tables
        ]
        return BlockMove(request.request_id, device_blocks, host_blocks)

    def swap_in_cost(self, request: Request, num_tokens: int) -> int:
        """Device blocks that bringing ``request`` back with ``num_tokens`` to run takes."""
        total = _ceil_div(request.num_computed_tokens + num_tokens, self.block_size)
        return sum(
            sum(1 for b in table if b >= 0) + max(0, total - len(table))
            for table in self._host_tables[request]
        )

    def swap_in(self, request: Request, num_tokens: int) -> BlockMove:
        """Device blocks for a swapped request's host blocks (and for ``num_tokens`` more)."""
        host_tables = self._host_tables.pop(request)
        move = BlockMove(request.request_id, [], [])
        device_tables = []
        for table in host_tables:
            device = [-1] * len(table)
            live = [i for i, b in enumerate(table) if b >= 0]
            for i, block in zip(live, self.allocator.allocate(len(live)), strict=True):
                device[i] = block
                move.device_blocks.append(block)
                move.host_blocks.append(table[i])
            device_tables.append(device)
        self._tables[request] = device_tables
        self._num_cached_blocks[request] = 0
        self._host_blocks_in_use.extend(move.host_blocks)
        self.allocate_slots(request, num_tokens)
        self._take_state_slot(request)
        return move

    def release_host(self, request: Request) -> None:
        """Free the swap-space blocks of a swapped request."""
        host_tables = self._host_tables.pop(request, None)
        if host_tables is not None:
            assert self.host_allocator is not None
            self.host_allocator.free(b for table in host_tables for b in table if b >= 0)

    def free_swapped_in(self) -> None:
        """Free the host blocks of the last step's swap-ins, whose copies have run by now
        (kept until then so that no swap-out of the step that read them overwrites them)."""
        if self._host_blocks_in_use:
            assert self.host_allocator is not None
            self.host_allocator.free(self._host_blocks_in_use)
            self._host_blocks_in_use = []

    def reset_prefix_cache(self) -> None:
        self.allocator.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.reset()

    # -- state checkpoints ------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step is being planned: the checkpoints the last one read may be reused
        (steps run in order, so its reads are done by the time this one's saves run)."""
        if self.checkpoints is not None:
            self.checkpoints.pinned.clear()

    def take_state_load(self, request: Request) -> int:
        """The checkpoint slot ``request``'s first chunk starts from (-1: none), once."""
        return self._state_load.pop(request, -1)

    def plan_checkpoint(self, request: Request, start: int, count: int) -> tuple[int, int] | None:
        """Where in the chunk ``[start, start + count)`` of ``request`` to save a checkpoint,
        and into which slot: after the last prompt block the chunk completes that a later
        request with the same prompt can hit (the prefix cache keeps its last token out),
        unless that block has one already (None: no checkpoint this chunk)."""
        checkpoints = self.checkpoints
        if checkpoints is None or count < 2:  # a single token runs with the decodes
            return None
        bs = self.block_size
        boundary = min(start + count, request.num_prompt_tokens - 1) // bs * bs
        if boundary <= start or boundary == 0:
            return None
        index = boundary // bs - 1
        hashes = extend_block_hashes(
            request.block_hashes, request.token_ids, bs, index + 1, request.cache_salt
        )
        block_hash = hashes[index]
        pending = self._pending_checkpoints.setdefault(request, [])
        if checkpoints.lookup(block_hash) is not None or any(p[1] == block_hash for p in pending):
            return None
        slot = checkpoints.take()
        if slot is None:
            return None
        pending.append((index, block_hash, slot))
        return boundary - start, slot

    def _final_blocks(self, request: Request) -> int:
        """Blocks per cache group that ``request`` holds at its final length."""
        return _ceil_div(_final_length(request), self.block_size)


def _final_length(request: Request) -> int:
    """The most tokens ``request`` can reach: its prompt plus ``max_new_tokens``."""
    return len(request.prompt_token_ids) + request.params.max_new_tokens
