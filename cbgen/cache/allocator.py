"""Fixed-size block bookkeeping for the paged KV cache, with prefix-cache reuse."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .prefix_cache import BlockHash


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; the scheduler prevents it."""


class BlockAllocator:
    """Block ids with reference counts, a free list and an LRU of reusable cached blocks.

    Every block is in exactly one state:

    * **in use**: reference count >= 1 (more than one when requests share a cached
      prefix block);
    * **free**: count 0 and no content worth keeping; the free list is a stack,
      so the block freed last is reused first and a long run keeps touching the
      same (warm, already committed) memory;
    * **evictable**: count 0 but registered in the prefix cache under a block
      hash (``cache_block``), so a later request with the same prefix can take it
      back with ``share``. These sit in least-recently-freed order.

    ``allocate`` hands out free blocks first and only then evicts the least
    recently used evictable block (dropping its hash). ``num_free`` counts both
    kinds, since either can be allocated.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # -- counts -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash_of[block]

    # -- plain allocation ---------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with a reference count of one, evicting cached ones if needed."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.num_free:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order.

        A block whose count reaches zero becomes evictable if it is cached (the
        first one released is the first evicted: free a request's blocks last
        to first so the tail of a prefix goes before its head), else free.
        """
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed while not allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (read-only; see ``share``)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference on cached blocks (found by ``lookup``)."""
        for block in blocks:
            if self._hash_of[block] is None:
                raise RuntimeError(f"block {block} is not in the prefix cache; it cannot be shared")
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1

    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register an in-use block whose tokens are all computed under ``block_hash``.

        Returns False (and leaves the block uncached) when another block already
        holds that hash, e.g. two requests computed the same prefix in one step.
        """
        if self._ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not allocated; only live blocks can be cached")
        if self._hash_of[block] is not None:
            return self._hash_of[block] == block_hash
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; evictable blocks become plain free blocks."""
        for block_hash, block in list(self._block_of.items()):
            del self._block_of[block_hash]
            self._hash_of[block] = None
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block] = None

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests; O(num_blocks))."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        for block in range(self.num_blocks):
            count = self._ref_counts[block]
            assert count >= 0, f"block {block} has a negative reference count"
            idle = block in free or block in evictable
            assert idle == (count == 0), f"block {block}: count {count}, idle {idle}"
            if block in free:
                assert self._hash_of[block] is None, f"free block {block} still has a hash"
            if block in evictable:
                assert self._hash_of[block] is not None, f"evictable block {block} has no hash"
        for block_hash, block in self._block_of.items():
            assert self._hash_of[block] == block_hash
        assert sum(h is not None for h in self._hash_of) == len(self._block_of)
