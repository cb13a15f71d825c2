"""The paged KV cache: block bookkeeping, prefix-cache hashing and the per-layer tensors."""

from .allocator import BlockAllocator, OutOfBlocksError
from .groups import AttentionKind, CacheGroup, build_groups
from .paged_cache import PagedKVCache
from .prefix_cache import hash_block, hash_blocks, prefix_caching_unsupported_reason

__all__ = [
    "AttentionKind",
    "BlockAllocator",
    "CacheGroup",
    "OutOfBlocksError",
    "PagedKVCache",
    "build_groups",
    "hash_block",
    "hash_blocks",
    "prefix_caching_unsupported_reason",
]
