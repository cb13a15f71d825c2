"""Scheduler invariants under random request mixes (no model involved).

A fake "step" applies the scheduler's decision the way the output processor
does, appending a dummy token for every chunk that completes its sequence. It
also keeps a fake KV cache: each written slot records which token prefix it was
computed from, so every chunk can check that the context it would attend to
(including blocks taken from the prefix cache) is exactly its own prefix.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from cbgen.cache.allocator import BlockAllocator
from cbgen.core.output_processor import OutputProcessor
from cbgen.core.scheduler import (
    FifoScheduler,
    PrefillFirstScheduler,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    make_scheduler,
)
from cbgen.requests.request import FinishReason, Request, RequestStatus
from cbgen.sampling.params import SamplingParams


class FakeModel:
    """Stands in for the forward pass: writes a fingerprint of each token's prefix."""

    def __init__(self, block_size: int, scheduler: Scheduler) -> None:
        self.block_size = block_size
        self.scheduler = scheduler
        self.kv: dict[int, int] = {}  # flat slot -> fingerprint of the prefix it encodes
        self.host_kv: dict[int, int] = {}  # the same for the swap space's slots
        self.prefix_ids: dict[int, list[int]] = {}  # id(request) -> fingerprint per position

    def _fingerprints(self, request: Request) -> list[int]:
        ids = self.prefix_ids.setdefault(id(request), [])
        while len(ids) < request.num_tokens:
            p = len(ids)
            # A placeholder (async scheduling) stands for the token the fake sampler
            # always draws, filled in "on the device" before the forward reads it.
            token = SAMPLED if p == request.pending_index else request.token_ids[p]
            ids.append(hash((ids[-1] if ids else 0, token)))
        return ids

    def _slot(self, chunk: ScheduledRequest, position: int) -> int:
        block = chunk.block_tables[0][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _copy(self, src: dict, dst: dict, src_blocks: list[int], dst_blocks: list[int]) -> None:
        bs = self.block_size
        for a, b in zip(src_blocks, dst_blocks, strict=True):
            for offset in range(bs):
                dst[b * bs + offset] = src.get(a * bs + offset)

    def run(self, out: SchedulerOutput) -> None:
        for move in out.swap_out:  # outs before ins, as the engine does
            self._copy(self.kv, self.host_kv, move.device_blocks, move.host_blocks)
        for move in out.swap_in:
            self._copy(self.host_kv, self.kv, move.host_blocks, move.device_blocks)
        for chunk in out.scheduled:
            request = _live(self.scheduler)[chunk.request_id]
            ids = self._fingerprints(request)
            for p in range(chunk.start):  # the context it attends to
                assert self.kv.get(self._slot(chunk, p)) == ids[p], "stale or foreign K/V"
            for p in range(chunk.start, chunk.end):
                self.kv[self._slot(chunk, p)] = ids[p]


def _live(scheduler: Scheduler) -> dict[str, Request]:
    return {r.request_id: r for r in scheduler.running + scheduler.swapped + scheduler.waiting}


SAMPLED = 7


def _apply(scheduler: Scheduler, out: SchedulerOutput, model: FakeModel | None = None) -> int:
    if model is not None:
        model.run(out)
    finished = 0
    live = _live(scheduler)
    for chunk in out.scheduled:
        request = live[chunk.request_id]
        if chunk.sample:
            request.token_ids.append(7)
            if request.num_output_tokens >= request.params.max_new_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
                finished += 1
    return finished


def _check_blocks(scheduler: Scheduler) -> None:
    allocator = scheduler.allocator
    allocator.check_invariants()
    holders = Counter(b for r in scheduler.running for b in _blocks(scheduler, r))
    for block, count in holders.items():
        assert allocator.ref_count(block) == count, "reference count differs from holders"
    assert allocator.num_free + len(holders) == allocator.num_blocks, "a block leaked"
    for r in scheduler.waiting:
        assert _blocks(scheduler, r) == [] and r.num_computed_tokens == 0
    for r in scheduler.swapped:
        assert r.status is RequestStatus.SWAPPED and _blocks(scheduler, r) == []
        assert r.num_computed_tokens > 0
    host = scheduler.host_allocator
    if host is not None:
        host.check_invariants()
        assert host.num_free + scheduler.kv.host_block_count() == host.num_blocks, (
            "a host block leaked"
        )


def _blocks(scheduler: Scheduler, request: Request) -> list[int]:
    return scheduler.block_tables(request)[0]


def _check_chunk_writes(scheduler: Scheduler, chunk: ScheduledRequest, block_size: int) -> None:
    """A chunk only writes blocks it owns alone and that are not in the prefix cache."""
    first = chunk.start // block_size
    last = -(-chunk.end // block_size)
    for block in chunk.block_tables[0][first:last]:
        assert scheduler.allocator.ref_count(block) == 1, "a shared block would be written"
        assert scheduler.allocator.block_hash(block) is None, "a cached block would be written"


@st.composite
def workloads(draw):
    """Requests built from a few shared prefixes, with arrival steps and priorities."""
    prefixes = draw(
        st.lists(st.lists(st.sampled_from([3, 4, 5]), max_size=40), min_size=1, max_size=3)
    )
    requests = []
    for _ in range(draw(st.integers(1, 20))):
        prefix = prefixes[draw(st.integers(0, len(prefixes) - 1))]
        suffix = draw(st.lists(st.sampled_from([3, 4, 5, 6]), max_size=20))
        prompt = (prefix + suffix) or [3]
        max_new = draw(st.integers(1, 20))
        arrive = draw(st.integers(0, 5))
        priority = draw(st.integers(0, 2))
        requests.append((prompt, max_new, arrive, priority))
    return requests


@settings(max_examples=300, deadline=None)
@given(
    requests=workloads(),
    policy=st.sampled_from(["fifo", "prefill_first"]),
    caching=st.booleans(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 40),
    max_batch_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    swap_blocks=st.sampled_from([0, 0, 3, 64]),
    async_steps=st.booleans(),
    admission=st.sampled_from(["eager", "full_length"]),
)
@example(  # a priority victim swapped out, then resumed in the same step: stale K/V
    requests=[([3, 3, 3, 3], 1, 4, 0)]
    + [([3, 3, 3, 3], 1, 0, 0)] * 3
    + [([3, 3, 3, 3], 4, 0, 1)]
    + [([3, 3, 3, 3], 1, 0, 0)] * 6,
    policy="fifo",
    caching=True,
    block_size=1,
    extra_blocks=0,
    max_batch_tokens=4,
    max_num_seqs=5,
    swap_blocks=64,
    async_steps=True,
    admission="eager",
)
def test_every_request_finishes_without_leaks(
    requests,
    policy,
    caching,
    block_size,
    extra_blocks,
    max_batch_tokens,
    max_num_seqs,
    swap_blocks,
    async_steps,
    admission,
):
    """Also under async scheduling: step N+1 is planned and run before step N's tokens
    are written back (the engine's order), so every check holds with placeholders."""
    longest = max(len(p) + n for p, n, _, _ in requests)
    # The engine guarantees one request alone always fits in the cache.
    num_blocks = -(-longest // block_size) + extra_blocks
    allocator = BlockAllocator(num_blocks)
    scheduler = make_scheduler(
        policy,
        allocator,
        block_size,
        max_batch_tokens,
        max_num_seqs,
        enable_prefix_caching=caching,
        swap_blocks=swap_blocks,
        admission=admission,
    )
    model = FakeModel(block_size, scheduler)
    pending = [
        (arrive, Request(str(i), prompt, SamplingParams(max_new_tokens=n, priority=prio), i))
        for i, (prompt, n, arrive, prio) in enumerate(requests)
    ]
    processor = OutputProcessor(set(), 1 << 30)
    finished, step = 0, 0
    in_flight = None

    def settle(samples) -> int:
        outputs, done = processor.resolve(samples, [SAMPLED] * len(samples.requests))
        for request, reason in done:
            assert reason is FinishReason.LENGTH
            scheduler.finish(request, reason)
        return len(done)

    while pending or scheduler.has_unfinished() or in_flight is not None:
        for item in [x for x in pending if x[0] <= step]:
            scheduler.add(item[1])
            pending.remove(item)
        keys = [r.sort_key for r in scheduler.waiting]
        assert keys == sorted(keys), "the queue is not in (priority, arrival) order"
        out = scheduler.schedule()
        waited = in_flight is not None  # an empty plan then only means "settle first"
        assert out.num_tokens <= max_batch_tokens
        assert len(scheduler.running) <= max_num_seqs
        assert len({c.request_id for c in out.scheduled}) == len(out.scheduled)
        live = _live(scheduler)
        for chunk in out.scheduled:
            request = live[chunk.request_id]
            assert request.status is RequestStatus.RUNNING
            assert chunk.num_tokens >= 1
            assert chunk.end <= request.num_tokens
            assert request.num_computed_tokens == chunk.end, "tokens not counted as computed"
            needed = -(-chunk.end // block_size)
            assert len(_blocks(scheduler, request)) >= needed, "chunk scheduled without its blocks"
            assert all(len(t) == needed for t in chunk.block_tables)
            _check_chunk_writes(scheduler, chunk, block_size)
        if scheduler.has_unfinished() and not pending and not waited:
            assert out.scheduled, "the scheduler stalled with work left"
        model.run(out)  # the engine waits for the step in flight before swap copies
        launched = processor.advance(out, live) if out.scheduled else None
        if in_flight is not None:
            finished += settle(in_flight)
        in_flight = None
        if launched is not None and async_steps:
            in_flight = launched
        elif launched is not None:
            finished += settle(launched)
        _check_blocks(scheduler)
        step += 1
        assert step < 5000
    assert finished == len(requests)
    assert allocator.num_free == num_blocks
    allocator.check_invariants()
    if swap_blocks:
        assert scheduler.host_allocator.num_free == swap_blocks, "host blocks leaked"
    stats = scheduler.stats
    if not caching:
        assert stats["cached_tokens"] == 0 and allocator.num_evictable == 0
    if admission == "full_length":
        assert stats["preemptions"] == 0, "full-length admission let the cache overflow"
    event(f"preempted: {stats['preemptions'] > 0}, swapped: {stats['swapped_out'] > 0}")
    event(f"cache hits: {stats['cached_tokens'] > 0}, evictions: {allocator.num_evictions > 0}")
    computed = stats["decode_tokens"] + stats["prefill_tokens"] + stats["cached_tokens"]
    assert computed >= sum(len(p) for p, *_ in requests)


def _request(rid: str, prompt: list[int], arrival: int, max_new: int = 10, priority: int = 0):
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, priority=priority), arrival)


def test_decodes_come_before_new_prefill():
    allocator = BlockAllocator(100)
    scheduler = Scheduler(allocator, 4, max_batch_tokens=10, max_num_seqs=8)
    scheduler.add(_request("a", [3] * 10, 0, max_new=5))
    _apply(scheduler, scheduler.schedule())  # whole prompt, first token sampled
    scheduler.add(_request("b", [4] * 50, 1, max_new=5))
    out = scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.scheduled] == [("a", 1), ("b", 9)]


def test_prefill_first_admits_before_decoding():
    allocator = BlockAllocator(100)
    scheduler = PrefillFirstScheduler(allocator, 4, max_batch_tokens=10, max_num_seqs=8)
    scheduler.add(_request("a", [3] * 10, 0, max_new=5))
    _apply(scheduler, scheduler.schedule())
    scheduler.add(_request("b", [4] * 50, 1, max_new=5))
    out = scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.scheduled] == [("b", 10)]
    # b is now a running prefill: it keeps going first; a decodes with what is left.
    scheduler.add(_request("c", [5] * 3, 2, max_new=5))
    _apply(scheduler, out)
    out = scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.scheduled] == [("b", 10)]


def test_prefill_first_leaves_the_decodes_their_blocks():
    # a decodes into a new block next step; with one block free, b must wait.
    allocator = BlockAllocator(4)
    scheduler = PrefillFirstScheduler(allocator, 4, max_batch_tokens=64, max_num_seqs=8)
    scheduler.add(_request("a", [3] * 11, 0))
    _apply(scheduler, scheduler.schedule())  # 3 blocks, 12 tokens known
    _apply(scheduler, scheduler.schedule())  # token 12 computed, 13 known
    scheduler.add(_request("b", [4] * 2, 1))
    out = scheduler.schedule()
    assert [c.request_id for c in out.scheduled] == ["a"] and not out.preempted
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_preemption_picks_the_newest_and_requeues_it_first():
    allocator = BlockAllocator(6)
    scheduler = FifoScheduler(allocator, 2, max_batch_tokens=64, max_num_seqs=8)
    old = _request("old", [3] * 4, 0)
    new = _request("new", [4] * 6, 1)
    scheduler.add(old)
    scheduler.add(new)
    _apply(scheduler, scheduler.schedule())  # 2 + 3 blocks used, one sampled token each
    # old needs a 3rd block and takes the last free one; new then needs a 4th, finds
    # none, and since old is already scheduled, new preempts itself.
    out = scheduler.schedule()
    assert [c.request_id for c in out.scheduled] == ["old"]
    assert out.preempted == ["new"]
    assert new.status is RequestStatus.WAITING and _blocks(scheduler, new) == []
    assert scheduler.waiting[0] is new
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 1


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_waiting_queue_is_served_by_priority_then_arrival(policy):
    allocator = BlockAllocator(64)
    scheduler = make_scheduler(policy, allocator, 4, max_batch_tokens=64, max_num_seqs=1)
    for rid, prio, arrival in [("p1", 1, 0), ("p0a", 0, 1), ("p2", 2, 2), ("p0b", 0, 3)]:
        scheduler.add(_request(rid, [3 + arrival] * 5, arrival, max_new=1, priority=prio))
    order = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        order += [c.request_id for c in out.scheduled]
        _apply(scheduler, out)
    assert order == ["p0a", "p0b", "p1", "p2"]


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_preemption_victim_is_the_lowest_priority_then_newest(policy):
    allocator = BlockAllocator(7)
    scheduler = make_scheduler(policy, allocator, 2, max_batch_tokens=64, max_num_seqs=8)
    urgent = _request("urgent", [3] * 4, 2, priority=0)  # newest but most urgent
    low_old = _request("low_old", [4] * 4, 0, priority=1)
    low_new = _request("low_new", [5] * 4, 1, priority=1)
    for r in (low_old, low_new, urgent):
        scheduler.add(r)
    _apply(scheduler, scheduler.schedule())  # 3 x 2 blocks, 1 free; 5 tokens each
    out = scheduler.schedule()  # every decode needs a 3rd block
    # urgent goes first and takes the free block; low_old needs one and preempts
    # low_new (same priority, newer), never urgent.
    assert [c.request_id for c in out.scheduled] == ["urgent", "low_old"]
    assert out.preempted == ["low_new"]
    assert scheduler.stats["preemptions"] == 1


def test_prefix_cache_reuse_caps_at_the_last_prompt_token():
    allocator = BlockAllocator(32)
    scheduler = Scheduler(allocator, 4, max_batch_tokens=64, max_num_seqs=8)
    first = _request("a", list(range(3, 15)), 0, max_new=1)  # 12 tokens: 3 full blocks
    scheduler.add(first)
    _apply(scheduler, scheduler.schedule())
    assert first.is_finished and allocator.num_evictable == 3
    same = _request("b", list(range(3, 15)), 1, max_new=1)
    longer = _request("c", list(range(3, 17)), 2, max_new=1)
    scheduler.add(same)
    scheduler.add(longer)
    out = scheduler.schedule()
    # b's whole prompt is cached but its last token must be computed: it reuses 2 blocks
    # and recomputes block 3 into a fresh block; c reuses all 3 and computes 2 tokens.
    assert [(c.request_id, c.start, c.num_tokens) for c in out.scheduled] == [
        ("b", 8, 4),
        ("c", 12, 2),
    ]
    assert same.num_cached_tokens == 8 and longer.num_cached_tokens == 12
    same_blocks, longer_blocks = _blocks(scheduler, same), _blocks(scheduler, longer)
    assert same_blocks[:2] == longer_blocks[:2] and same_blocks[2] != longer_blocks[2]
    assert allocator.ref_count(longer_blocks[0]) == 2
    assert scheduler.stats["cached_tokens"] == 20


def test_same_prefix_in_one_step_is_computed_once():
    allocator = BlockAllocator(32)
    scheduler = Scheduler(allocator, 4, max_batch_tokens=64, max_num_seqs=8)
    a = _request("a", [3] * 9, 0, max_new=2)
    b = _request("b", [3] * 8 + [4], 1, max_new=2)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [c.request_id for c in out.scheduled] == ["a"]  # b waits for a's blocks
    _apply(scheduler, out)
    out = scheduler.schedule()
    assert [(c.request_id, c.start) for c in out.scheduled] == [("a", 9), ("b", 8)]
    assert b.num_cached_tokens == 8


def test_disabled_prefix_cache_never_shares():
    allocator = BlockAllocator(32)
    scheduler = Scheduler(allocator, 4, 64, 8, enable_prefix_caching=False)
    for i in range(3):
        scheduler.add(_request(str(i), [3] * 9, i, max_new=3))
    while scheduler.has_unfinished():
        _apply(scheduler, scheduler.schedule())
        _check_blocks(scheduler)
        holders = Counter(b for r in scheduler.running for b in _blocks(scheduler, r))
        assert max(holders.values(), default=1) == 1
    assert allocator.num_cached == 0 and allocator.num_free == 32


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown scheduler policy"):
        make_scheduler("lifo", BlockAllocator(4), 4, 16, 4)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_waiting_request_of_higher_priority_preempts_a_running_one(policy):
    allocator = BlockAllocator(64)
    scheduler = make_scheduler(policy, allocator, 4, max_batch_tokens=64, max_num_seqs=2)
    low = [_request(f"low{i}", [3 + i] * 6, i, max_new=50, priority=1) for i in range(2)]
    for r in low:
        scheduler.add(r)
    _apply(scheduler, scheduler.schedule())  # both run: every slot is taken
    same = _request("same", [7] * 5, 2, max_new=1, priority=1)
    scheduler.add(same)
    out = scheduler.schedule()  # equal priority waits its turn
    assert not out.preempted and same in scheduler.waiting
    _apply(scheduler, out)
    urgent = _request("urgent", [8] * 5, 3, max_new=1, priority=0)
    scheduler.add(urgent)
    out = scheduler.schedule()
    assert out.preempted == ["low1"]  # the newest of the lowest priority
    assert "urgent" in [c.request_id for c in out.scheduled]
    assert low[1].status is RequestStatus.WAITING and _blocks(scheduler, low[1]) == []
    _apply(scheduler, out)
    while scheduler.has_unfinished():
        _apply(scheduler, scheduler.schedule())
    assert allocator.num_free == 64
