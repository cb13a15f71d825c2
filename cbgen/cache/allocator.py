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
    * **free**: count 0 and no content worth keeping;
    * **evictable**: count 0 but registered in the prefix cache under a block
      hash (``cache_block``), so a later request with the same prefix can take it
      back with ``share``. These sit in least-recently-freed order.

    ``allocate`` hands out free blocks first and only then evicts the least
    recently used evictable block (dropping its hash). ``num_free`` counts both
    kinds, since either can be allocated.

    Where a free block goes matters on CPU: the decode kernel reads a request's
    blocks in order, and the hardware prefetcher follows a contiguous run of
    memory but not scattered pages (a 64-request decode step of SmolLM2 at 400
    tokens of context took 199 ms with each request's blocks in a row and 259 ms
    with them shuffled). So ``allocate`` places blocks: it continues a request's
    run (``after``) while the next block is free, and starts a new run at the
    lowest block that begins ``region`` open blocks in a row. The blocks of that
    region past the ones taken stay free but not *open*: other new runs start
    elsewhere while there is room, so the request can grow in place. Freeing a
    block reopens it and the closed free blocks after it (the rest of its
    owner's region). The lowest-first choice also keeps the touched part of a
    lazily committed cache small. Placement is only a preference: any free block
    serves when the preferred ones are taken.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._is_free = bytearray(b"\x01") * num_blocks  # 1: plain free (not evictable)
        self._open = bytearray(b"\x01") * num_blocks  # 1: free and in nobody's region
        self._num_plain_free = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # -- counts -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: truly free plus evictable cached ones."""
        return self._num_plain_free + len(self._evictable)

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

    def allocate(self, count: int, after: int | None = None, region: int = 0) -> list[int]:
        """``count`` blocks with a reference count of one, evicting cached ones if needed.

        ``after`` is the caller's last block: the new ones continue its run where
        ``after + 1``, ``after + 2``... are free. ``region`` is how many blocks the
        caller expects to need in all from here (at least ``count``): a new run
        starts where that many are free in a row, when there is such a place.
        """
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.num_free:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free} free")
        blocks: list[int] = []
        following = after + 1 if after is not None and after >= 0 else -1
        while len(blocks) < count:
            if 0 <= following < self.num_blocks and self._is_free[following]:
                block = following
            else:
                block = self._run_start(region - len(blocks), count - len(blocks))
                if block >= 0:  # a new run: keep the rest of its region for it
                    end = min(self.num_blocks, block + max(1, region - len(blocks)))
                    self._open[block:end] = bytes(end - block)
            if block < 0:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            else:
                self._is_free[block] = 0
                self._open[block] = 0
                self._num_plain_free -= 1
            self._ref_counts[block] = 1
            blocks.append(block)
            following = block + 1
        return blocks

    def _run_start(self, wanted: int, needed: int) -> int:
        """The lowest block starting ``wanted`` open blocks in a row, else ``needed``
        open, else ``needed`` free, else the lowest open or free block; -1 when no
        block is plainly free."""
        if self._num_plain_free == 0:
            return -1
        for flags, length in ((self._open, wanted), (self._open, needed), (self._is_free, needed)):
            if 1 < length <= self._num_plain_free:
                start = flags.find(b"\x01" * length)
                if start >= 0:
                    return start
        start = self._open.find(1)
        return start if start >= 0 else self._is_free.find(1)

    def _reopen(self, block: int) -> None:
        """Open a freed block and the closed free blocks right after it."""
        self._open[block] = 1
        block += 1
        while block < self.num_blocks and self._is_free[block] and not self._open[block]:
            self._open[block] = 1
            block += 1

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
                    self._is_free[block] = 1
                    self._num_plain_free += 1
                    self._reopen(block)

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
        for block in self._evictable:
            self._is_free[block] = 1
            self._reopen(block)
        self._num_plain_free += len(self._evictable)
        self._evictable.clear()

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block] = None

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests; O(num_blocks))."""
        free = {block for block, flag in enumerate(self._is_free) if flag}
        evictable = set(self._evictable)
        assert len(free) == self._num_plain_free, "the free count is off"
        opened = {block for block, flag in enumerate(self._open) if flag}
        assert opened <= free, "an open block is not free"
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
