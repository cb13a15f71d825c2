"""The paged KV cache: block bookkeeping and the per-layer tensors."""

from .allocator import BlockAllocator, OutOfBlocksError
from .paged_cache import PagedKVCache

__all__ = ["BlockAllocator", "OutOfBlocksError", "PagedKVCache"]
