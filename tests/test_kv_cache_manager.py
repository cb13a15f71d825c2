"""The KV-cache manager on its own: block tables of every group, prefix cache, swap and
rollback, driven by random operation sequences (no model, no scheduler)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.cache.allocator import BlockAllocator
from cbgen.cache.groups import AttentionKind, CacheGroup
from cbgen.cache.kv_cache_manager import KVCacheManager
from cbgen.requests.request import Request
from cbgen.sampling.params import SamplingParams

FULL = CacheGroup(0, AttentionKind.FULL, (0,))
WINDOW = CacheGroup(1, AttentionKind.SLIDING_WINDOW, (1,), window=5)


def _request(rid: str, prompt: list[int], max_new: int = 50) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new), 0)


def _check(manager: KVCacheManager, live: list[Request]) -> None:
    """Every held block is counted once per holder, and nothing else is in use."""
    allocator = manager.allocator
    allocator.check_invariants()
    holders = Counter(b for r in live for table in manager.block_tables(r) for b in table if b >= 0)
    for block, count in holders.items():
        assert allocator.ref_count(block) == count, "reference count differs from holders"
    assert allocator.num_free + len(holders) == allocator.num_blocks, "a block leaked"
    # Only cached prefix blocks of the first group are ever shared.
    for block, count in holders.items():
        if count > 1:
            assert allocator.block_hash(block) is not None, "a shared block is not a cached one"
    if manager.state_slots is not None:
        # One state slot per live request, none shared, none lost.
        slots = [manager.state_slot(r) for r in live]
        assert all(slot >= 0 for slot in slots), "a live request holds no state slot"
        assert len(set(slots)) == len(slots), "two requests share a state slot"
        assert manager.state_slots.num_free + len(slots) == manager.state_slots.num_slots
    checkpoints = manager.checkpoints
    if checkpoints is not None:
        # Every checkpoint slot is free, registered under one hash, or pending: once.
        pending = [slot for plans in manager._pending_checkpoints.values() for *_, slot in plans]
        held = list(checkpoints.by_hash.values()) + pending + checkpoints._free
        assert sorted(held) == list(
            range(checkpoints.first_slot, checkpoints.first_slot + checkpoints.num_slots)
        ), "a checkpoint slot leaked or is held twice"
    for r in live:
        tables = manager.block_tables(r)
        assert len(tables) == len(manager.groups), "a group's table is missing"
        lengths = {len(t) for t in tables}
        assert len(lengths) == 1, "groups cover different numbers of tokens"
        for group, table in zip(manager.groups, tables, strict=True):
            if not group.is_windowed:
                assert -1 not in table, "a full-attention group dropped a block"


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "rollback", "window", "swap", "free", "checkpoint"]),
        st.integers(0, 3),  # which request
        st.integers(1, 9),  # how many tokens
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=operations,
    windowed=st.booleans(),
    caching=st.booleans(),
    block_size=st.sampled_from([1, 2, 4]),
    swap_blocks=st.sampled_from([0, 8]),
    state_slots=st.sampled_from([0, 4]),
)
def test_random_operations_never_leak_or_share_a_written_block(
    ops, windowed, caching, block_size, swap_blocks, state_slots
):
    groups = [FULL, WINDOW] if windowed else [FULL]
    manager = KVCacheManager(
        BlockAllocator(64),
        block_size,
        groups,
        enable_prefix_caching=caching,
        swap_blocks=swap_blocks,
        state_slots=state_slots,  # 4 requests at most: always one free at admission
        state_checkpoints=3 if state_slots else 0,
    )
    # Requests share a prefix, so the prefix cache has something to hand out.
    prompts = [[3] * 8 + [4 + i] * 4 for i in range(4)]
    requests = [_request(str(i), prompts[i]) for i in range(4)]
    live: list[Request] = []
    swapped: list[Request] = []
    for op, index, count in ops:
        request = requests[index]
        if op == "admit" and request not in live and request not in swapped:
            request.num_computed_tokens = 0
            hits = manager.cached_prefix(request)
            cached = len(hits) * block_size
            count = request.num_tokens - cached
            if manager.admission_cost(request, hits, count) > manager.num_free:
                continue
            manager.admit(request, hits, count)
            # A chunk only writes blocks no one else holds and no cache entry names.
            for block in manager.block_ids(request)[len(hits) :]:
                assert manager.allocator.ref_count(block) == 1
                assert manager.allocator.block_hash(block) is None
            request.num_computed_tokens = request.num_tokens
            live.append(request)
        elif op == "grow" and request in live:
            if manager.blocks_needed(request, count) > manager.num_free:
                continue
            manager.allocate_slots(request, count)
            request.token_ids.extend([5] * count)
            start = request.num_computed_tokens
            request.num_computed_tokens += count
            written = slice(start // block_size, -(-request.num_computed_tokens // block_size))
            for table in manager.block_tables(request):
                for block in table[written]:  # the blocks the new tokens are written to
                    assert block >= 0 and manager.allocator.ref_count(block) == 1
                    assert manager.allocator.block_hash(block) is None
        elif op == "rollback" and request in live:
            keep = max(request.num_prompt_tokens, request.num_computed_tokens - count)
            manager.rollback(request, keep)
            del request.token_ids[keep:]
            request.num_computed_tokens = keep
            for table in manager.block_tables(request):
                assert len(table) == -(-keep // block_size)
        elif op == "window" and request in live:
            manager.drop_out_of_window(request)
        elif op == "swap" and request in live:
            move = manager.swap_out(request)
            if move is None:
                continue
            manager.free(request)
            live.remove(request)
            swapped.append(request)
        elif op == "swap" and request in swapped:
            if manager.swap_in_cost(request, 0) > manager.num_free:
                continue
            manager.swap_in(request, 0)
            swapped.remove(request)
            live.append(request)
        elif op == "checkpoint" and request in live:
            start = max(0, request.num_computed_tokens - count)
            plan = manager.plan_checkpoint(request, start, count)
            if plan is not None:
                offset, slot = plan
                assert 0 < offset <= count and (start + offset) % block_size == 0
                assert start + offset < request.num_prompt_tokens
        elif op == "free" and request in live:
            manager.free(request)
            live.remove(request)
        elif op == "free" and request in swapped:
            manager.release_host(request)
            swapped.remove(request)
        manager.free_swapped_in()
        _check(manager, live)
    for request in live:
        manager.free(request)
    for request in swapped:
        manager.release_host(request)
    manager.free_swapped_in()
    assert manager.num_free == 64
    if manager.host_allocator is not None:
        assert manager.host_allocator.num_free == swap_blocks
    if manager.state_slots is not None:
        assert manager.state_slots.num_free == state_slots
    if manager.checkpoints is not None:
        assert not manager._pending_checkpoints or not any(manager._pending_checkpoints.values())


def test_rollback_of_rejected_tokens_frees_their_blocks_and_keeps_them_out_of_the_cache():
    manager = KVCacheManager(BlockAllocator(16), 4)
    request = _request("a", list(range(3, 9)))  # 6 tokens: blocks 0, 1
    manager.admit(request, [], 6)
    request.num_computed_tokens = 6
    # 1 + k = 5 tokens to verify (positions 6..10) take a third block.
    manager.allocate_slots(request, 5)
    request.token_ids.extend([20, 21, 22, 23, 24])
    request.num_computed_tokens = 11
    assert len(manager.block_ids(request)) == 3
    free_before = manager.num_free
    # The last j = 3 are rejected: 8 tokens remain, in exactly two blocks.
    manager.rollback(request, 8)
    del request.token_ids[8:]
    request.num_computed_tokens = 8
    assert len(manager.block_ids(request)) == 2
    assert manager.num_free == free_before + 1
    manager.register_computed(request)  # two full blocks of accepted tokens
    assert manager.num_cached_blocks(request) == 2
    manager.free(request)
    assert manager.num_free == 16
    # A second request with the accepted prefix takes both blocks from the cache; one
    # that differs in the rejected positions takes only the first.
    same = _request("b", list(range(3, 9)) + [20, 21, 7])
    other = _request("c", list(range(3, 9)) + [22, 23, 7])
    assert len(manager.cached_prefix(same)) == 2
    assert len(manager.cached_prefix(other)) == 1


def test_windowed_group_gives_back_blocks_its_window_no_longer_reads():
    manager = KVCacheManager(BlockAllocator(32), 2, [FULL, WINDOW])
    request = _request("a", list(range(3, 15)))  # 12 tokens: 6 blocks per group
    manager.admit(request, [], 12)
    request.num_computed_tokens = 12
    manager.drop_out_of_window(request)
    full, window = manager.block_tables(request)
    # A query at position 12 reads keys 8..12: window blocks 0..3 are dropped.
    assert -1 not in full and window[:4] == [-1] * 4 and min(window[4:]) >= 0
    assert manager.num_free == 32 - 6 - 2
    manager.free(request)
    assert manager.num_free == 32
