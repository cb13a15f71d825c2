"""Decide, each step, which requests run and how many of their tokens.

Two policies share one base class and differ only in the order of a step's phases:

* ``FifoScheduler`` (``"fifo"``): decodes, then running prefills, then new requests;
* ``PrefillFirstScheduler`` (``"prefill_first"``): running prefills, then new requests
  (when memory allows without starving the decodes of blocks), then decodes.

Both honour ``SamplingParams.priority``: the waiting queue and each phase are ordered by
``(priority, arrival)``, and the preemption victim is the running request with the
highest such key (lowest priority, then newest). A waiting request that cannot start
(no sequence slot, or too few free blocks for its first chunk) preempts running
requests of a strictly lower priority (a higher value) until it can, except under
full-length admission, which never preempts.

Preemption frees a request's blocks for others. By default (recompute) its K/V is
dropped and recomputed when it is admitted again; with a swap space
(``swap_blocks > 0``) its computed blocks are copied to host memory instead (the
scheduler lists the copies in ``SchedulerOutput.swap_out``) and copied back when it
resumes (``swap_in``), before new requests are admitted. When the swap space is full
the victim falls back to recompute.

With prefix caching on, admission looks up the chain hashes of the request's full
blocks (``cbgen.cache.prefix_cache``) and takes every cached block of its prefix by
reference instead of computing it again.

Cache groups (``cbgen.cache.groups``): a request holds one block list per group,
all drawn from the one allocator. Group 0's list is ``request.block_ids``; the
others live in the scheduler (``block_tables(request)`` gives them all). Before
each step a sliding-window group's blocks that no query of the request can read
any more go back to the free list; their entries become ``-1``.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cache.allocator import BlockAllocator
from .cache.groups import FULL_GROUP, CacheGroup
from .cache.prefix_cache import BlockHash, extend_block_hashes
from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request``, starting at its ``num_computed_tokens``."""

    request: Request
    num_tokens: int
    # One block list per cache group (``Scheduler.block_tables``); None: ``[request.block_ids]``.
    block_tables: list[list[int]] | None = None

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the request's last known token, so it yields a sample."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class BlockMove:
    """A swap copy: ``device_blocks[i]`` <-> ``host_blocks[i]`` for ``request``."""

    request: Request
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass
class SchedulerOutput:
    """One step's decisions. The block copies must run before the step's forward pass:
    every ``swap_out`` first (they read blocks this step may hand to others), then
    every ``swap_in``."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[BlockMove] = field(default_factory=list)
    swap_in: list[BlockMove] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class _Step:
    """Bookkeeping of the step being planned."""

    budget: int
    scheduled: set[int] = field(default_factory=set)  # id() of requests with a chunk
    in_flight: set[BlockHash] = field(default_factory=set)  # full blocks computed this step
    in_flight_seen: int = 0  # chunks already folded into in_flight


def _final_length(request: Request) -> int:
    """The most tokens ``request`` can reach: its prompt plus ``max_new_tokens``."""
    return len(request.prompt_token_ids) + request.params.max_new_tokens


def _key(request: Request) -> tuple[int, int]:
    return request.sort_key


DECODE, PREFILL, ADMIT = "decode", "prefill", "admit"


class Scheduler:
    """Continuous batching with chunked prefill, priorities and prefix caching.

    Every step spends a budget of ``max_batch_tokens`` over three phases, in the
    order ``phases`` gives (the base class runs FIFO's order):

    * ``decode``: one token for each running request whose prompt is done;
    * ``prefill``: the rest of the prompt of running requests still in prefill;
    * ``admit``: new requests from the waiting queue, whose prompts are cut into
      chunks to fit. Admission stops at the first request that does not fit, so
      the queue order is kept; it is skipped in a step that had to preempt.

    When a running request needs a block and none is left, the running request
    with the highest ``(priority, arrival)`` not yet scheduled this step (possibly
    the one asking) is preempted: its blocks go back and it rejoins the queue, to
    be recomputed later (from the prefix cache, if its blocks survive).

    Prefix caching (``enable_prefix_caching``): once a request's block is full and
    computed it is registered under its chain hash; at admission a request takes
    the longest run of cached blocks of its prefix (shared and read-only), capped
    at ``num_tokens - 1`` tokens rounded down to whole blocks, so the last token is
    always computed (its logits are sampled) and it lands in a block of its own:
    a shared block is never written, so no copy-on-write is needed. A request
    whose next uncached block is being computed by another request in this very
    step waits a step and then reuses it instead of computing it twice.

    ``stats`` counts ``prefill_tokens`` (computed tokens that were not decodes),
    ``decode_tokens``, ``cached_tokens`` (taken from the cache at admission) and
    ``preemptions``.

    ``groups`` are the cache groups (default: one full-attention group). Block
    counts are summed over groups; sliding-window groups drop their out-of-window
    blocks at the start of every step. Prefix caching needs a single
    full-attention group and is switched off otherwise.
    """

    policy = "fifo"
    phases: tuple[str, ...] = (DECODE, PREFILL, ADMIT)

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch_tokens: int,
        max_num_seqs: int,
        *,
        enable_prefix_caching: bool = True,
        groups: Sequence[CacheGroup] | None = None,
        swap_blocks: int = 0,
        admission: str = "eager",
    ) -> None:
        self.allocator = allocator
        # "full_length": admit only what fits to the end (EngineConfig.admission).
        self.full_length_admission = admission == "full_length"
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.groups: tuple[CacheGroup, ...] = tuple(groups) if groups else (FULL_GROUP,)
        self._windowed = [i for i, g in enumerate(self.groups) if g.is_windowed]
        single_full = len(self.groups) == 1 and not self._windowed
        self.enable_prefix_caching = enable_prefix_caching and single_full
        self._more_tables: dict[Request, list[list[int]]] = {}  # groups 1.. of each request
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # sorted by (priority, arrival)
        # The host swap space's block ids (None: preemption always recomputes).
        self.host_allocator = BlockAllocator(swap_blocks) if swap_blocks > 0 else None
        self._host_tables: dict[Request, list[list[int]]] = {}  # swapped requests' host blocks
        # Host blocks of last step's swap-ins: freed only once those copies have run.
        self._host_blocks_in_use: list[int] = []
        self.stats: dict[str, int] = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cached_tokens": 0,
            "preemptions": 0,
            "swapped_out": 0,
            "swapped_in": 0,
            "swap_failures": 0,
        }

    # -- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        insort(self.waiting, request, key=_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire a request (finished, aborted): drop it from its queue and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self._release_host(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._free_swapped_in()  # the step that read them is over

    def _free_swapped_in(self) -> None:
        """Free the host blocks of the last step's swap-ins, whose copies have run by now.

        They are kept until the next ``schedule`` (or ``finish``, called after the step)
        so that no swap-out of the step that read them can overwrite them.
        """
        if self._host_blocks_in_use:
            assert self.host_allocator is not None
            self.host_allocator.free(self._host_blocks_in_use)
            self._host_blocks_in_use = []

    # -- the step ---------------------------------------------------------------------

    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's block list of every cache group (``-1``: a block dropped from a window)."""
        more = self._more_tables.get(request)
        return [request.block_ids, *more] if more else [request.block_ids]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._free_swapped_in()
        if self.enable_prefix_caching:
            for request in self.running:
                self._cache_computed_blocks(request)
        if self._windowed:
            for request in self.running:
                self._drop_out_of_window(request)
        by_priority = self._make_room_for_priority(out)
        step = _Step(self.max_batch_tokens)
        running = sorted(self.running, key=_key)
        # A request whose pending token is its last (async scheduling) is not run again.
        decoding = [
            r
            for r in running
            if r.num_tokens - r.num_computed_tokens == 1
            and r.num_output_tokens < r.params.max_new_tokens
        ]
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for phase in self.phases:
            if phase == DECODE:
                self._schedule_running(decoding, step, out)
            elif phase == PREFILL:
                self._schedule_running(prefilling, step, out)
            elif len(out.preempted) == by_priority:  # else the cache is full: admitting
                # more would only thrash (preempted for a higher priority is the exception)
                if self.full_length_admission:
                    reserve = sum(self._blocks_to_finish(r) for r in self.running)
                else:
                    reserve = sum(
                        self._blocks_needed(r, 1)
                        for r in decoding
                        if r.status is RequestStatus.RUNNING and id(r) not in step.scheduled
                    )
                if self.swapped:
                    self._resume(step, out, reserve)
                if not self.swapped:  # swapped requests come back before new ones start
                    self._admit(step, out, reserve)
        self._count(out)
        return out

    def _make_room_for_priority(self, out: SchedulerOutput) -> int:
        """Preempt running requests of lower priority than the head of the queue while it
        could not start for lack of a slot or of blocks; returns how many. Not under
        full-length admission, which promises that nothing is ever preempted."""
        count = 0
        if self.full_length_admission:
            return count
        while self.waiting and self.running:
            head = self.waiting[0]
            victim = max(self.running, key=_key)
            if victim.params.priority <= head.params.priority:
                break
            first_chunk = min(head.num_tokens, self.max_batch_tokens)
            needed = -(-first_chunk // self.block_size) * len(self.groups)
            # A block of slack per running request: their decodes come first.
            room = self.allocator.num_free - len(self.running)
            if len(self.running) < self.max_num_seqs and needed <= room:
                break
            # Recomputed, never swapped: a swapped request resumes before waiting ones
            # start, so it would come straight back in this very step.
            self._preempt(victim, out, allow_swap=False)
            count += 1
        return count

    def _schedule_running(self, requests: list[Request], step: _Step, out: SchedulerOutput) -> None:
        for request in requests:
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if not self._reserve_or_preempt(request, num_tokens, step, out):
                continue
            out.chunks.append(self._chunk(request, num_tokens))
            step.scheduled.add(id(request))
            step.budget -= num_tokens

    def _admit(self, step: _Step, out: SchedulerOutput, reserve: int) -> None:
        """Start waiting requests; ``reserve`` blocks stay free for this step's decodes."""
        bs = self.block_size
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self._cached_prefix(request)
            if self._next_block_in_flight(request, len(hits), step, out):
                break  # reuse it next step rather than compute it twice
            num_cached = len(hits) * bs
            num_tokens = min(request.num_tokens - num_cached, step.budget)
            total = -(-(num_cached + num_tokens) // bs)
            needed = total - len(hits) + total * (len(self.groups) - 1)
            revived = sum(1 for block in hits if self.allocator.ref_count(block) == 0)
            final = self._final_blocks(request)
            growth = 0  # blocks it may take later, kept free under full-length admission
            if self.full_length_admission:
                growth = max(0, final - total) * len(self.groups)
            free = self.allocator.num_free - needed - revived - reserve
            if free < 0 or (self.running and free < growth):  # alone, it always fits
                break
            reserve += growth
            self.waiting.pop(0)
            self.allocator.share(hits)
            request.block_ids = hits + self.allocator.allocate(
                total - len(hits),
                after=hits[-1] if hits else None,
                region=final - len(hits),
            )
            if len(self.groups) > 1:
                self._more_tables[request] = [
                    self.allocator.allocate(total) for _ in self.groups[1:]
                ]
            request.num_cached_blocks = len(hits)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self.stats["cached_tokens"] += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_tokens))
            step.scheduled.add(id(request))
            step.budget -= num_tokens

    # -- swap -------------------------------------------------------------------------

    def _resume(self, step: _Step, out: SchedulerOutput, reserve: int) -> None:
        """Bring swapped requests back (queue order) while their blocks fit."""
        bs = self.block_size
        while self.swapped and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            host_tables = self._host_tables[request]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
            total = -(-(request.num_computed_tokens + num_tokens) // bs)
            needed = sum(
                sum(1 for b in table if b >= 0) + max(0, total - len(table))
                for table in host_tables
            )
            if needed + reserve > self.allocator.num_free:
                break
            self.swapped.pop(0)
            del self._host_tables[request]
            move = BlockMove(request, [], [])
            device_tables = []
            for table in host_tables:
                device = [-1] * len(table)
                live = [i for i, b in enumerate(table) if b >= 0]
                for i, block in zip(live, self.allocator.allocate(len(live)), strict=True):
                    device[i] = block
                    move.device_blocks.append(block)
                    move.host_blocks.append(table[i])
                device_tables.append(device)
            request.block_ids = device_tables[0]
            if len(device_tables) > 1:
                self._more_tables[request] = device_tables[1:]
            self._host_blocks_in_use.extend(move.host_blocks)
            out.swap_in.append(move)
            request.num_cached_blocks = 0
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._grow(request, num_tokens)
            out.chunks.append(self._chunk(request, num_tokens))
            step.scheduled.add(id(request))
            step.budget -= num_tokens
            self.stats["swapped_in"] += 1

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        """Copy ``request``'s computed blocks to the swap space; False if they do not fit."""
        host = self.host_allocator
        if host is None or request.num_computed_tokens == 0:
            return False
        computed = -(-request.num_computed_tokens // self.block_size)
        tables = [table[:computed] for table in self.block_tables(request)]
        device_blocks = [b for table in tables for b in table if b >= 0]
        if len(device_blocks) > host.num_free:
            return False
        host_blocks = host.allocate(len(device_blocks))
        take = iter(host_blocks)
        self._host_tables[request] = [
            [next(take) if b >= 0 else -1 for b in table] for table in tables
        ]
        out.swap_out.append(BlockMove(request, device_blocks, host_blocks))
        self.stats["swapped_out"] += 1
        return True

    def swap_failed(self, move: BlockMove, out: SchedulerOutput) -> None:
        """A copy of ``move`` failed: its request is recomputed instead, leaking nothing.

        Called before the step runs. The request leaves this step (its chunk is
        dropped), gives back every device and host block it holds and waits to be
        prefilled again from its tokens.
        """
        request = move.request
        self.stats["swap_failures"] += 1
        out.chunks = [c for c in out.chunks if c.request is not request]
        if request.status is RequestStatus.RUNNING:  # a failed swap-in
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:  # a failed swap-out
            self.swapped.remove(request)
            self._release_host(request)
        else:
            return  # already finished or requeued: nothing of it is left
        request.num_computed_tokens = 0  # nothing it holds is valid K/V any more
        self._release(request)
        request.status = RequestStatus.WAITING
        insort(self.waiting, request, key=_key)

    # -- prefix caching ---------------------------------------------------------------

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks of the request's prefix, at most ``num_tokens - 1`` tokens' worth."""
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(
            request.block_hashes, request.token_ids, self.block_size, limit
        )
        return self.allocator.lookup(hashes[:limit])

    def _next_block_in_flight(
        self, request: Request, num_hits: int, step: _Step, out: SchedulerOutput
    ) -> bool:
        if (
            not self.enable_prefix_caching
            or num_hits >= (request.num_tokens - 1) // self.block_size
        ):
            return False
        next_hash = request.block_hashes[num_hits]
        bs = self.block_size
        while step.in_flight_seen < len(out.chunks):
            chunk = out.chunks[step.in_flight_seen]
            step.in_flight_seen += 1
            other = chunk.request
            first = chunk.start // bs
            # Never hash a placeholder (async scheduling): only known tokens.
            known = other.num_tokens if other.pending_index is None else other.pending_index
            last = min(-(-(chunk.start + chunk.num_tokens) // bs), known // bs)
            if last > first:
                hashes = extend_block_hashes(other.block_hashes, other.token_ids, bs, last)
                step.in_flight.update(hashes[first:last])
        return next_hash in step.in_flight

    def _cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, full)
        for index in range(request.num_cached_blocks, full):
            self.allocator.cache_block(request.block_ids[index], hashes[index])
        request.num_cached_blocks = full

    # -- helpers ----------------------------------------------------------------------

    def _chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        tables = self.block_tables(request) if len(self.groups) > 1 else None
        return ScheduledChunk(request, num_tokens, tables)

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        total = -(-(request.num_computed_tokens + num_tokens) // self.block_size)
        return sum(max(0, total - len(blocks)) for blocks in self.block_tables(request))

    def _final_blocks(self, request: Request) -> int:
        """Blocks per cache group that ``request`` holds at its final length."""
        return -(-_final_length(request) // self.block_size)

    def _blocks_to_finish(self, request: Request) -> int:
        """Blocks ``request`` may still take: up to its prompt plus ``max_new_tokens``."""
        remaining = _final_length(request) - request.num_computed_tokens
        return self._blocks_needed(request, max(0, remaining))

    def _grow(self, request: Request, num_tokens: int) -> None:
        """Give every group of ``request`` the blocks for ``num_tokens`` more tokens."""
        total = -(-(request.num_computed_tokens + num_tokens) // self.block_size)
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

    def _drop_out_of_window(self, request: Request) -> None:
        """Free the blocks of windowed groups that no future query of ``request`` reads."""
        tables = self.block_tables(request)
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

    def _reserve_or_preempt(
        self, request: Request, num_tokens: int, step: _Step, out: SchedulerOutput
    ) -> bool:
        """Give ``request`` the blocks it needs, preempting lower-ranked requests if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        needed = self._blocks_needed(request, num_tokens)
        while needed > self.allocator.num_free:
            victim = max(
                (r for r in self.running if id(r) not in step.scheduled), key=_key
            )  # ``request`` is a candidate itself, so this is never empty
            self._preempt(victim, out)
            if victim is request:
                return False
        self._grow(request, num_tokens)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput, allow_swap: bool = True) -> None:
        self.running.remove(request)
        swapped = allow_swap and self._swap_out(request, out)
        self._release(request)
        request.num_preemptions += 1
        if swapped:  # keeps num_computed_tokens: its K/V comes back with it
            request.status = RequestStatus.SWAPPED
            insort(self.swapped, request, key=_key)
        else:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            insort(self.waiting, request, key=_key)
        out.preempted.append(request)
        self.stats["preemptions"] += 1

    def _release(self, request: Request) -> None:
        if self.enable_prefix_caching and request.block_ids:
            self._cache_computed_blocks(request)
        for blocks in self.block_tables(request):
            # Last block first: the tail of a prefix is evicted before its head.
            self.allocator.free(b for b in reversed(blocks) if b >= 0)
        request.block_ids = []
        self._more_tables.pop(request, None)
        request.num_cached_blocks = 0

    def _release_host(self, request: Request) -> None:
        """Free the swap-space blocks of a swapped request."""
        host_tables = self._host_tables.pop(request, None)
        if host_tables is not None:
            assert self.host_allocator is not None
            self.host_allocator.free(b for table in host_tables for b in table if b >= 0)

    def _count(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            request = chunk.request
            if chunk.start == request.num_tokens - 1 and request.num_output_tokens > 0:
                self.stats["decode_tokens"] += 1
            else:
                self.stats["prefill_tokens"] += chunk.num_tokens


class FifoScheduler(Scheduler):
    """Running decodes first, then running prefills, then admissions in queue order."""

    policy = "fifo"
    phases = (DECODE, PREFILL, ADMIT)


class PrefillFirstScheduler(Scheduler):
    """Prefills (running, then newly admitted) before decodes, to fill batches faster.

    New requests are admitted only while the blocks the decodes of this step need
    stay free, so admission never forces a decode out; decodes take the budget left.
    """

    policy = "prefill_first"
    phases = (PREFILL, ADMIT, DECODE)


POLICIES: dict[str, type[Scheduler]] = {
    FifoScheduler.policy: FifoScheduler,
    PrefillFirstScheduler.policy: PrefillFirstScheduler,
}


def make_scheduler(
    policy: str,
    allocator: BlockAllocator,
    block_size: int,
    max_batch_tokens: int,
    max_num_seqs: int,
    *,
    enable_prefix_caching: bool = True,
    groups: Sequence[CacheGroup] | None = None,
    swap_blocks: int = 0,
    admission: str = "eager",
) -> Scheduler:
    """The scheduler of ``policy`` (``"fifo"`` or ``"prefill_first"``)."""
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown scheduler policy {policy!r}; use one of {sorted(POLICIES)}"
        ) from None
    return cls(
        allocator,
        block_size,
        max_batch_tokens,
        max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        groups=groups,
        swap_blocks=swap_blocks,
        admission=admission,
    )
