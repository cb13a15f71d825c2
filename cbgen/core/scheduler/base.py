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

Blocks are the ``KVCacheManager``'s (``cbgen.cache.kv_cache_manager``): every block
table of every cache group, the prefix cache, the swap space and window eviction. The
scheduler asks it what a request needs and tells it what to allocate or free; it keeps
the queues, the policy and the token budget.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Container, Iterable, Sequence

from ...cache.allocator import BlockAllocator
from ...cache.groups import CacheGroup
from ...cache.kv_cache_manager import KVCacheManager
from ...requests.request import FinishReason, Request, RequestStatus
from ...requests.scheduler_output import ScheduledRequest, SchedulerOutput
from .preemption import Preemption
from .step_plan import StepPlan, request_key

DECODE, PREFILL, ADMIT = "decode", "prefill", "admit"


class Scheduler(Preemption):
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

    Prefix caching, swap and windows are the ``KVCacheManager``'s (``self.kv``): a
    request admitted takes the cached blocks of its prefix, and one whose next
    uncached block another request computes in this very step waits a step to reuse it.

    A decoding request with proposed tokens (``draft_token_ids``) is given 1 + k
    tokens; at the next step (or at its finish) the computed positions past its last
    known token, the rejected proposals, are rolled back.

    ``stats`` counts ``prefill_tokens`` (computed tokens that were not decodes),
    ``decode_tokens``, ``cached_tokens`` (taken from the cache at admission) and
    ``preemptions``.

    ``groups`` are the cache groups (default: one full-attention group).
    ``state_slots`` (the model's state layers: ``max_num_seqs``) gives every running
    request a state slot; no more than ``max_num_seqs`` requests ever run, so one is
    always free at admission. ``state_checkpoints`` more slots keep states at cached
    prefix boundaries (``cbgen.cache.state.StateCheckpoints``).
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
        state_slots: int = 0,
        state_checkpoints: int = 0,
    ) -> None:
        self.kv = KVCacheManager(
            allocator,
            block_size,
            groups,
            enable_prefix_caching=enable_prefix_caching,
            swap_blocks=swap_blocks,
            state_slots=state_slots,
            state_checkpoints=state_checkpoints,
        )
        # "full_length": admit only what fits to the end (EngineConfig.admission).
        self.full_length_admission = admission == "full_length"
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len: int | None = None  # proposals never run past it (the engine's)
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # sorted by (priority, arrival)
        self.stats: dict[str, float] = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cached_tokens": 0,
            "preemptions": 0,
            "swapped_out": 0,
            "swapped_in": 0,
            "swap_failures": 0,
        }

    @property
    def allocator(self) -> BlockAllocator:
        return self.kv.allocator

    @property
    def host_allocator(self) -> BlockAllocator | None:
        return self.kv.host_allocator

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        return self.kv.groups

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv.enable_prefix_caching

    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's block list of every cache group (``-1``: a block dropped from a window)."""
        return self.kv.block_tables(request)

    # -- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        insort(self.waiting, request, key=request_key)

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
            self.kv.release_host(request)
        self._discard_rejected(request, leaving=True)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free_swapped_in()  # the step that read them is over

    def recompute_all(self, only: Container[Request] | None = None) -> None:
        """Send every running and swapped request (``only``: of these) back to wait with
        no K/V: it computes its tokens again when readmitted (the weights its K/V came
        from changed). Not a preemption: nothing is counted."""
        for request in [*self.running, *self.swapped]:
            if only is not None and request not in only:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
                self._discard_rejected(request, leaving=True)
                self.kv.free(request)
            else:
                self.swapped.remove(request)
                self.kv.release_host(request)
            request.draft_token_ids = []
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            insort(self.waiting, request, key=request_key)
        self.kv.free_swapped_in()

    def update_from_output(self, requests: Iterable[Request]) -> None:
        """A step settled for ``requests`` (the output processor accepted their tokens and
        retired the finished ones): the K/V of the proposals it rejected goes now, so the
        next ``schedule()`` plans from settled state and data flows one way."""
        for request in requests:
            if request.status is RequestStatus.RUNNING:
                self._discard_rejected(request)

    def _discard_rejected(self, request: Request, leaving: bool = False) -> None:
        """Forget the K/V of rejected proposals: computed positions past the request's
        last known token held tokens the output processor did not accept (the accepted
        ones and the token after them are its last tokens now). Their blocks go back and
        nothing of them is registered in the prefix cache.

        While a step that verifies proposals is in flight (async scheduling) which of them
        hold is not known yet; a request ``leaving`` its blocks then (finished, preempted)
        keeps only the positions before the pending token, so no proposal is cached or
        swapped out."""
        if request.pending_index is None:
            last = request.num_tokens - 1
        elif leaving:
            last = request.pending_index
        else:
            return
        if request.num_computed_tokens > last:
            request.num_computed_tokens = max(last, 0)
            self.kv.rollback(request, request.num_computed_tokens)

    # -- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        kv = self.kv
        kv.free_swapped_in()
        kv.begin_step()
        if kv.enable_prefix_caching:
            for request in self.running:
                kv.register_computed(request)
        if kv.has_windows:
            for request in self.running:
                kv.drop_out_of_window(request)
        by_priority = self._make_room_for_priority(out)
        step = StepPlan(self.max_batch_tokens)
        running = sorted(self.running, key=request_key)
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
                    reserve = sum(kv.blocks_to_finish(r) for r in self.running)
                else:
                    reserve = sum(
                        kv.blocks_needed(r, 1)
                        for r in decoding
                        if r.status is RequestStatus.RUNNING and id(r) not in step.scheduled
                    )
                if self.swapped:
                    self._resume(step, out, reserve)
                if not self.swapped:  # swapped requests come back before new ones start
                    self._admit(step, out, reserve)
        self._emit(step, out)
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
            victim = max(self.running, key=request_key)
            if victim.params.priority <= head.params.priority:
                break
            needed = self.kv.blocks_for_first_chunk(min(head.num_tokens, self.max_batch_tokens))
            # A block of slack per running request: their decodes come first.
            room = self.kv.num_free - len(self.running)
            if len(self.running) < self.max_num_seqs and needed <= room:
                break
            # Recomputed, never swapped: a swapped request resumes before waiting ones
            # start, so it would come straight back in this very step.
            self._preempt(victim, out, allow_swap=False)
            count += 1
        return count

    def _schedule_running(
        self, requests: list[Request], step: StepPlan, out: SchedulerOutput
    ) -> None:
        for request in requests:
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_tokens == 1 and request.draft_token_ids:
                num_tokens += self._num_drafts(request, step.budget - 1)
            if not self._reserve_or_preempt(request, num_tokens, step, out):
                continue
            self._add_chunk(request, num_tokens, step, out)

    def _num_drafts(self, request: Request, room: int) -> int:
        """How many of ``request``'s proposed tokens to verify this step: none with a token
        still being sampled, and never past ``max_new_tokens`` or the context limit."""
        if request.pending_index is not None or request.params.needs_history:
            return 0
        left = request.params.max_new_tokens - request.num_output_tokens - 1
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - request.num_tokens - 1)
        return max(0, min(len(request.draft_token_ids), room, left))

    def _admit(self, step: StepPlan, out: SchedulerOutput, reserve: int) -> None:
        """Start waiting requests; ``reserve`` blocks stay free for this step's decodes."""
        kv = self.kv
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = kv.cached_prefix(request)
            if kv.next_block_in_flight(request, len(hits), step.in_flight, step.chunks):
                break  # reuse it next step rather than compute it twice
            num_cached = len(hits) * self.block_size
            num_tokens = min(request.num_tokens - num_cached, step.budget)
            growth = 0  # blocks it may take later, kept free under full-length admission
            if self.full_length_admission:
                growth = kv.growth_after(request, num_cached, num_tokens)
            free = kv.num_free - kv.admission_cost(request, hits, num_tokens) - reserve
            if free < 0 or (self.running and free < growth):  # alone, it always fits
                break
            reserve += growth
            self.waiting.pop(0)
            kv.admit(request, hits, num_tokens)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self.stats["cached_tokens"] += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_chunk(request, num_tokens, step, out)

    def _add_chunk(
        self, request: Request, num_tokens: int, step: StepPlan, out: SchedulerOutput
    ) -> None:
        step.chunks.append((request, request.num_computed_tokens, num_tokens))
        step.scheduled.add(id(request))
        step.budget -= num_tokens

    def _emit(self, step: StepPlan, out: SchedulerOutput) -> None:
        """Write the step's chunks into ``out`` as values and count their tokens as
        computed (the K/V is written by the time anything reads it: steps run in order)."""
        kv = self.kv
        for request, start, count in step.chunks:
            if start == request.num_tokens - 1 and request.num_output_tokens > 0:
                self.stats["decode_tokens"] += count
            else:
                self.stats["prefill_tokens"] += count
            out.scheduled.append(
                ScheduledRequest.of(
                    request,
                    start,
                    count,
                    kv.block_tables(request),
                    self.block_size,
                    kv.state_slot(request),
                    kv.take_state_load(request),
                    kv.plan_checkpoint(request, start, count),
                )
            )
            request.num_computed_tokens = start + count
