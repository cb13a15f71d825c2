"""Fixed-size block bookkeeping for the paged KV cache."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; the scheduler prevents it."""


class BlockAllocator:
    """A free list of block ids with reference counts.

    Reference counts are here from the start so that prefix sharing can hand the
    same block to several requests later; today every allocated block has a
    count of one. The free list is a stack: the block freed last is reused
    first, so a long run keeps touching the same (warm, already committed)
    memory instead of walking through the whole cache budget.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed while not allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
