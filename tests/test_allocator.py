"""Block allocator invariants."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.cache.allocator import BlockAllocator, OutOfBlocksError
from cbgen.cache.prefix_cache import hash_blocks


def test_allocate_and_free_round_trip():
    allocator = BlockAllocator(8)
    first = allocator.allocate(3)
    assert len(set(first)) == 3 and allocator.num_free == 5
    allocator.free(first)
    assert allocator.num_free == 8


def test_over_allocation_and_double_free_are_errors():
    allocator = BlockAllocator(2)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(3)
    blocks = allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(RuntimeError, match="not allocated"):
        allocator.free(blocks[:1])
    with pytest.raises(ValueError):
        BlockAllocator(0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 6), st.integers(0, 8)),
        max_size=60,
    ),
    st.integers(1, 20),
)
def test_random_operations_never_leak_or_share(ops, num_blocks):
    """Placement hints (``after``, ``region``) never change what is handed out, only where."""
    allocator = BlockAllocator(num_blocks)
    owned: list[list[int]] = []
    for action, n, extra in ops:
        if action == "free" and owned:
            allocator.free(owned.pop(n % len(owned)))
        elif n > allocator.num_free:
            with pytest.raises(OutOfBlocksError):
                allocator.allocate(n)
        elif action == "grow" and owned and owned[n % len(owned)]:
            blocks = owned[n % len(owned)]
            blocks.extend(allocator.allocate(n, after=blocks[-1], region=n + extra))
        else:
            owned.append(allocator.allocate(n, region=n + extra))
        held = [b for blocks in owned for b in blocks]
        assert len(held) == len(set(held)), "a block was handed out twice"
        assert allocator.num_free + len(held) == num_blocks
        assert all(allocator.ref_count(b) == 1 for b in held)
        allocator.check_invariants()
    for blocks in owned:
        allocator.free(blocks)
    assert allocator.num_free == num_blocks
    allocator.check_invariants()


def test_requests_growing_side_by_side_keep_their_blocks_in_a_row():
    """Each new run starts past the others' regions, so interleaved growth stays
    contiguous per request while the cache has room."""
    allocator = BlockAllocator(64)
    runs = [allocator.allocate(2, region=8) for _ in range(4)]
    for _ in range(6):  # one block each per round, as decode steps take them
        for blocks in runs:
            blocks.extend(allocator.allocate(1, after=blocks[-1], region=8 - len(blocks)))
    for blocks in runs:
        assert blocks == list(range(blocks[0], blocks[0] + 8))
    freed = runs.pop(0)
    allocator.free(freed)
    # The freed region is open again: the next run starts there, lowest first.
    assert allocator.allocate(3, region=8) == freed[:3]


def test_placement_falls_back_to_any_free_block_when_regions_fill_the_cache():
    allocator = BlockAllocator(6)
    first = allocator.allocate(1, region=4)  # keeps blocks 1-3 for itself
    second = allocator.allocate(2, region=2)
    assert first == [0] and second == [4, 5]
    third = allocator.allocate(3, region=3)  # only the first run's room is left
    assert sorted(third) == [1, 2, 3] and allocator.num_free == 0


# -- prefix caching: sharing, LRU eviction --------------------------------------------


def _cache_all(allocator: BlockAllocator, blocks: list[int], tokens: list[int], bs: int) -> None:
    for block, block_hash in zip(blocks, hash_blocks(tokens, bs), strict=False):
        allocator.cache_block(block, block_hash)


def test_freed_cached_blocks_stay_reusable_until_memory_is_needed():
    allocator = BlockAllocator(6)
    tokens = [5, 6, 7, 8, 9, 10]
    blocks = allocator.allocate(3)
    _cache_all(allocator, blocks, tokens, 2)
    allocator.free(reversed(blocks))
    assert allocator.num_free == 6 and allocator.num_evictable == 3
    # The same prefix finds all three; a diverging second block stops the match.
    assert allocator.lookup(hash_blocks(tokens, 2)) == blocks
    assert allocator.lookup(hash_blocks([5, 6, 0, 0], 2)) == blocks[:1]
    allocator.share(blocks[:2])
    assert allocator.ref_count(blocks[0]) == 1 and allocator.num_evictable == 1
    # Truly free blocks go first: three are left, no eviction yet.
    fresh = allocator.allocate(3)
    assert not set(fresh) & set(blocks) and allocator.num_evictions == 0
    assert allocator.lookup(hash_blocks(tokens, 2)) == blocks
    # Now only the evictable third block is left: taking it drops its hash.
    (evicted,) = allocator.allocate(1)
    assert evicted == blocks[2] and allocator.num_evictions == 1
    assert allocator.block_hash(evicted) is None
    assert allocator.lookup(hash_blocks(tokens, 2)) == blocks[:2]
    allocator.check_invariants()


def test_eviction_takes_the_least_recently_freed_block_first():
    allocator = BlockAllocator(4)
    first, second = allocator.allocate(2), allocator.allocate(2)
    _cache_all(allocator, first, [1, 1, 1, 1], 2)
    _cache_all(allocator, second, [2, 2, 2, 2], 2)
    allocator.free(reversed(first))  # tail of a prefix before its head
    allocator.free(reversed(second))
    assert allocator.allocate(1) == [first[1]]
    assert allocator.allocate(1) == [first[0]]
    assert allocator.allocate(1) == [second[1]]
    with pytest.raises(RuntimeError, match="not in the prefix cache"):
        allocator.share([first[0]])


def test_duplicate_hash_is_not_registered_twice():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(1), allocator.allocate(1)
    (h,) = hash_blocks([3, 3], 2)
    assert allocator.cache_block(a[0], h) and not allocator.cache_block(b[0], h)
    allocator.free(a + b)
    assert allocator.num_evictable == 1 and allocator.lookup([h]) == a
    with pytest.raises(RuntimeError, match="not allocated"):
        allocator.cache_block(a[0], h)
    allocator.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.sampled_from([3, 4]), min_size=1, max_size=9)),
        max_size=40,
    ),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 3]),
)
def test_random_sharing_keeps_counts_exact_and_never_leaks(ops, num_blocks, block_size):
    """Requests with prefixes over a two-token alphabet share, free and evict at random."""
    bs = block_size
    allocator = BlockAllocator(num_blocks)
    owners: list[tuple[list[int], list[int]]] = []  # (tokens, blocks) of live requests
    content: dict[int, tuple[int, ...]] = {}  # cached block -> the whole prefix it ends
    for start, tokens in ops:
        if start or not owners:
            hashes = hash_blocks(tokens, bs)
            limit = (len(tokens) - 1) // bs
            hits = allocator.lookup(hashes[:limit])
            for i, block in enumerate(hits):  # a hit is always the same prefix
                assert content[block] == tuple(tokens[: (i + 1) * bs])
            needed = -(-len(tokens) // bs) - len(hits)
            revived = sum(allocator.ref_count(b) == 0 for b in hits)
            if needed + revived > allocator.num_free:
                continue
            held = {b for _, blocks in owners for b in blocks}
            allocator.share(hits)
            fresh = allocator.allocate(needed)
            assert not set(fresh) & held, "a block in use was handed out again"
            for block in fresh:
                content.pop(block, None)
            blocks = hits + fresh
            for i in range(len(hits), len(tokens) // bs):  # computed: register
                if allocator.cache_block(blocks[i], hashes[i]):
                    content[blocks[i]] = tuple(tokens[: (i + 1) * bs])
            owners.append((tokens, blocks))
        else:
            _, blocks = owners.pop(len(tokens) % len(owners))
            allocator.free(reversed(blocks))
        allocator.check_invariants()
        holders = Counter(b for _, blocks in owners for b in blocks)
        for block, count in holders.items():
            assert allocator.ref_count(block) == count
        assert allocator.num_free + len(holders) == num_blocks
    for _, blocks in owners:
        allocator.free(reversed(blocks))
    allocator.check_invariants()
    assert allocator.num_free == num_blocks == allocator._num_plain_free + allocator.num_evictable
    assert all(allocator.ref_count(b) == 0 for b in range(num_blocks))
