"""Scheduler invariants under random request mixes (no model involved).

A fake "step" applies the scheduler's decision the way the output processor
does, appending a dummy token for every chunk that completes its sequence.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.cache.allocator import BlockAllocator
from cbgen.request import FinishReason, Request, RequestStatus
from cbgen.sampling import SamplingParams
from cbgen.scheduler import Scheduler


def _apply(scheduler: Scheduler, out) -> int:
    finished = 0
    for chunk in out.chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
    for chunk in out.chunks:
        request = chunk.request
        if request.num_computed_tokens == request.num_tokens:
            request.token_ids.append(7)
            if request.num_output_tokens >= request.params.max_new_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
                finished += 1
    return finished


def _check_blocks(scheduler: Scheduler, block_size: int) -> None:
    held = [b for r in scheduler.running for b in r.block_ids]
    assert len(held) == len(set(held)), "two requests share a block"
    assert scheduler.allocator.num_free + len(held) == scheduler.allocator.num_blocks
    for r in scheduler.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0


requests_strategy = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 5)), min_size=1, max_size=25
)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests_strategy,
    block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 40),
    max_batch_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
)
def test_every_request_finishes_without_leaks(
    requests, block_size, extra_blocks, max_batch_tokens, max_num_seqs
):
    longest = max(p + n for p, n, _ in requests)
    # The engine guarantees one request alone always fits in the cache.
    num_blocks = -(-longest // block_size) + extra_blocks
    allocator = BlockAllocator(num_blocks)
    scheduler = Scheduler(allocator, block_size, max_batch_tokens, max_num_seqs)
    pending = [
        (arrive, Request(str(i), [3] * p, SamplingParams(max_new_tokens=n), i))
        for i, (p, n, arrive) in enumerate(requests)
    ]
    finished, step = 0, 0
    while pending or scheduler.has_unfinished():
        for item in [x for x in pending if x[0] <= step]:
            scheduler.add(item[1])
            pending.remove(item)
        out = scheduler.schedule()
        assert out.num_tokens <= max_batch_tokens
        assert len(scheduler.running) <= max_num_seqs
        assert len({id(c.request) for c in out.chunks}) == len(out.chunks)
        for chunk in out.chunks:
            request = chunk.request
            assert request.status is RequestStatus.RUNNING
            assert chunk.num_tokens >= 1
            assert chunk.start + chunk.num_tokens <= request.num_tokens
            needed = -(-(chunk.start + chunk.num_tokens) // block_size)
            assert len(request.block_ids) >= needed, "chunk scheduled without its blocks"
        if scheduler.has_unfinished() and not pending:
            assert out.chunks, "the scheduler stalled with work left"
        finished += _apply(scheduler, out)
        _check_blocks(scheduler, block_size)
        step += 1
        assert step < 5000
    assert finished == len(requests)
    assert allocator.num_free == num_blocks


def test_decodes_come_before_new_prefill():
    allocator = BlockAllocator(100)
    scheduler = Scheduler(allocator, 4, max_batch_tokens=10, max_num_seqs=8)
    first = Request("a", [3] * 10, SamplingParams(max_new_tokens=5), 0)
    scheduler.add(first)
    _apply(scheduler, scheduler.schedule())  # whole prompt, first token sampled
    scheduler.add(Request("b", [3] * 50, SamplingParams(max_new_tokens=5), 1))
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]


def test_preemption_picks_the_newest_and_requeues_it_first():
    allocator = BlockAllocator(6)
    scheduler = Scheduler(allocator, 2, max_batch_tokens=64, max_num_seqs=8)
    old = Request("old", [3] * 4, SamplingParams(max_new_tokens=10), 0)
    new = Request("new", [3] * 6, SamplingParams(max_new_tokens=10), 1)
    scheduler.add(old)
    scheduler.add(new)
    _apply(scheduler, scheduler.schedule())  # 2 + 3 blocks used, one sampled token each
    # old needs a 3rd block and takes the last free one; new then needs a 4th, finds
    # none, and since old is already scheduled, new preempts itself.
    out = scheduler.schedule()
    assert [c.request for c in out.chunks] == [old]
    assert out.preempted == [new]
    assert new.status is RequestStatus.WAITING and new.block_ids == []
    assert scheduler.waiting[0] is new
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 1
