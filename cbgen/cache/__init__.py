"""The paged KV cache: block bookkeeping, prefix-cache hashing and the per-layer tensors."""

from .allocator import BlockAllocator, OutOfBlocksError
from .paged_cache import PagedKVCache
from .prefix_cache import hash_block, hash_blocks, prefix_caching_unsupported_reason

__all__ = [
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedKVCache",
    "hash_block",
    "hash_blocks",
    "prefix_caching_unsupported_reason",
]
