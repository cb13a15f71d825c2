"""Block allocator invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.cache.allocator import BlockAllocator, OutOfBlocksError


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
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60), st.integers(1, 20))
def test_random_operations_never_leak_or_share(ops, num_blocks):
    allocator = BlockAllocator(num_blocks)
    owned: list[list[int]] = []
    for do_alloc, n in ops:
        if do_alloc or not owned:
            if n <= allocator.num_free:
                owned.append(allocator.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    allocator.allocate(n)
        else:
            allocator.free(owned.pop(n % len(owned)))
        held = [b for blocks in owned for b in blocks]
        assert len(held) == len(set(held)), "a block was handed out twice"
        assert allocator.num_free + len(held) == num_blocks
        assert all(allocator.ref_count(b) == 1 for b in held)
    for blocks in owned:
        allocator.free(blocks)
    assert allocator.num_free == num_blocks
