"""Decide, each step, which requests run and how many of their tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache.allocator import BlockAllocator
from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request``, starting at its ``num_computed_tokens``."""

    request: Request
    num_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the request's last known token, so it yields a sample."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """First-come first-served continuous batching with chunked prefill.

    Every step spends a budget of ``max_batch_tokens``: first one token for each
    running request that is decoding, then the remaining prompt of running
    requests still in prefill, then new requests from the waiting queue, whose
    prompts are cut into chunks to fit. When the cache runs out of blocks the
    newest running request is preempted: its blocks go back and it returns to
    the front of the queue to be recomputed later.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire a request (finished, aborted): drop it from its queue and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # -- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_or_preempt(request, num_tokens, scheduled, out):
                continue
            out.chunks.append(ScheduledChunk(request, num_tokens))
            scheduled.add(id(request))
            budget -= num_tokens

        if out.preempted:
            return out  # the cache is full: admitting more would only thrash
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            needed = self._blocks_needed(request, num_tokens)
            if needed > self.allocator.num_free:
                break
            self.waiting.popleft()
            request.block_ids.extend(self.allocator.allocate(needed))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_tokens))
            budget -= num_tokens
        return out

    # -- helpers ----------------------------------------------------------------------

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        total = request.num_computed_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def _reserve_or_preempt(
        self, request: Request, num_tokens: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Give ``request`` the blocks it needs, preempting newer requests if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        needed = self._blocks_needed(request, num_tokens)
        while needed > self.allocator.num_free:
            victim = self._newest_unscheduled(exclude=request, scheduled=scheduled)
            if victim is None:
                self._preempt(request, out)
                return False
            self._preempt(victim, out)
        request.block_ids.extend(self.allocator.allocate(needed))
        return True

    def _newest_unscheduled(self, exclude: Request, scheduled: set[int]) -> Request | None:
        for candidate in reversed(self.running):
            if candidate is not exclude and id(candidate) not in scheduled:
                return candidate
        return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.allocator.free(request.block_ids)
            request.block_ids = []
