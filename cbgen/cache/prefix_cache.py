"""Prefix caching helpers: stable chain hashes of full blocks, and when caching is exact.

A full block of ``block_size`` tokens is named by ``hash(parent_digest, its tokens)``,
where ``parent_digest`` names the block before it (empty for the first block). Two
requests get the same digest for block ``i`` only if their first ``(i + 1) * block_size``
tokens agree, so a cached block's K/V can stand in for recomputing that prefix.

The digest is BLAKE2b over the parent digest and the token ids packed as little-endian
int64: the same in every process and on every platform (unlike Python's salted
``hash``). The block-state bookkeeping (reference counts, the LRU of reusable
blocks) lives in ``BlockAllocator``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .groups import CacheGroup

BlockHash = bytes

DIGEST_SIZE = 16
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The digest of one full block given the digest of the block before it."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + payload, digest_size=DIGEST_SIZE).digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Digests of every full block of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def salted_root(salt: bytes) -> BlockHash:
    """The digest a request's first block chains from: ``ROOT_HASH`` for the base model,
    a digest of ``salt`` otherwise (a LoRA adapter and its weights' generation), so K/V
    computed under other weights never matches."""
    if not salt:
        return ROOT_HASH
    return hashlib.blake2b(b"cbgen-salt:" + salt, digest_size=DIGEST_SIZE).digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    count: int,
    salt: bytes = b"",
) -> list[BlockHash]:
    """Grow ``hashes`` in place to the first ``count`` full blocks of ``token_ids``
    (the first chained from ``salted_root(salt)``).

    Tokens of a full block never change once known (a request only appends), so
    digests computed earlier stay valid and each block is hashed once.
    """
    count = min(count, len(token_ids) // block_size)
    while len(hashes) < count:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else salted_root(salt)
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
    return hashes


def prefix_caching_unsupported_reason(
    model_config: Any, groups: Sequence[CacheGroup] | None = None
) -> str | None:
    """Why prefix caching would not be exact for this model, or None when it is.

    Caching shares whole prefixes of full-attention blocks. A sliding-window
    layer drops its blocks older than the window while a request runs, so a
    later request could not find the K/V of a cached prefix's last window there:
    caching is off for any model with a windowed layer.

    ``groups`` are the cache groups the engine's probe found by running the
    model (the ground truth: the window each attention module passes). Without
    them the model config decides: ``sliding_window`` set and used by some layer
    per ``layer_types``, or by every layer when there is no ``layer_types``.
    """
    if groups is not None:
        windowed = [g for g in groups if g.window is not None]
        if not windowed:
            return None
        layers = sum(len(g.layers) for g in windowed)
        total = sum(len(g.layers) for g in groups)
        windows = sorted({g.window for g in windowed if g.window is not None})
        sizes = ", ".join(str(w) for w in windows)
        return f"{layers} of {total} layers use a sliding window ({sizes})"
    config = model_config
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config() or config
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sliding = [t for t in layer_types if "sliding" in str(t) or "chunked" in str(t)]
        if not sliding:
            return None
        return f"{len(sliding)} of {len(layer_types)} layers use a sliding window ({window})"
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return f"the model uses a sliding window ({window})"
