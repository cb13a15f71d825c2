"""Preemption and swap of a ``Scheduler``: who gives its blocks up when memory runs out,
where its K/V goes (recomputed later, or copied to host memory and back), and how a
failed copy is undone. A mixin of ``Scheduler``, which keeps the queues and the budget.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable

from ...cache.kv_cache_manager import KVCacheManager
from ...requests.request import Request, RequestStatus
from ...requests.scheduler_output import BlockMove, SchedulerOutput
from .step_plan import StepPlan, request_key


class Preemption:
    """See the module's docstring."""

    running: list[Request]
    waiting: list[Request]
    swapped: list[Request]
    kv: KVCacheManager
    stats: dict[str, float]
    max_num_seqs: int
    _add_chunk: Callable[[Request, int, StepPlan, SchedulerOutput], None]
    _discard_rejected: Callable[..., None]

    # -- swap -------------------------------------------------------------------------

    def _resume(self, step: StepPlan, out: SchedulerOutput, reserve: int) -> None:
        """Bring swapped requests back (queue order) while their blocks fit."""
        while self.swapped and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if self.kv.swap_in_cost(request, num_tokens) + reserve > self.kv.num_free:
                break
            self.swapped.pop(0)
            out.swap_in.append(self.kv.swap_in(request, num_tokens))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_chunk(request, num_tokens, step, out)
            self.stats["swapped_in"] += 1

    def swap_failed(self, move: BlockMove, out: SchedulerOutput) -> None:
        """A copy of ``move`` failed: its request is recomputed instead, leaking nothing.

        Called before the step runs. The request leaves this step (its chunk is
        dropped), gives back every device and host block it holds and waits to be
        prefilled again from its tokens.
        """
        self.stats["swap_failures"] += 1
        request = next(
            (r for r in self.running + self.swapped if r.request_id == move.request_id), None
        )
        if request is None:
            return  # already finished or requeued: nothing of it is left
        out.drop({request.request_id})
        if request.status is RequestStatus.RUNNING:  # a failed swap-in
            self.running.remove(request)
        else:  # a failed swap-out
            self.swapped.remove(request)
            self.kv.release_host(request)
        request.num_computed_tokens = 0  # nothing it holds is valid K/V any more
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        insort(self.waiting, request, key=request_key)

    # -- helpers ----------------------------------------------------------------------

    def _reserve_or_preempt(
        self, request: Request, num_tokens: int, step: StepPlan, out: SchedulerOutput
    ) -> bool:
        """Give ``request`` the blocks it needs, preempting lower-ranked requests if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        needed = self.kv.blocks_needed(request, num_tokens)
        while needed > self.kv.num_free:
            victim = max(
                (r for r in self.running if id(r) not in step.scheduled), key=request_key
            )  # ``request`` is a candidate itself, so this is never empty
            self._preempt(victim, out)
            if victim is request:
                return False
        self.kv.allocate_slots(request, num_tokens)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput, allow_swap: bool = True) -> None:
        self.running.remove(request)
        self._discard_rejected(request, leaving=True)
        move = self.kv.swap_out(request) if allow_swap else None
        self.kv.free(request)
        request.num_preemptions += 1
        if move is not None:  # keeps num_computed_tokens: its K/V comes back with it
            out.swap_out.append(move)
            self.stats["swapped_out"] += 1
            request.status = RequestStatus.SWAPPED
            insort(self.swapped, request, key=request_key)
        else:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            insort(self.waiting, request, key=request_key)
        out.preempted.append(request.request_id)
        self.stats["preemptions"] += 1
