"""How the engine's memory is cut up, decided once from the probed layers and the config:
K/V blocks, state slots and checkpoints, and the longest request that fits.

Kept apart from the step loop because it runs at build time only and is pure arithmetic
over the model's layers and the budget; ``EngineCore`` allocates what the plan says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from ..cache.groups import CacheGroup, LayerSpec, build_groups, max_request_tokens, tensor_layout
from ..cache.paged_cache import bytes_per_token, default_cache_budget
from ..cache.prefix_cache import prefix_caching_unsupported_reason
from ..cache.state import StateSpec, state_bytes_per_request
from .config import EngineConfig, resolve_kv_cache_dtype
from .model_facts import model_context_limit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    """The cache an engine allocates. ``layers`` are as the cache stores them (the KV
    dtype applied); ``prefix_caching_off`` says why prefix caching cannot be exact for
    this model (None: it can)."""

    layers: list[LayerSpec]
    groups: list[CacheGroup]
    bytes_per_token: int
    state_specs: list[StateSpec]
    state_bytes_per_request: int
    prefix_caching_off: str | None
    num_checkpoints: int
    num_blocks: int
    max_model_len: int

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_caching_off is None

    def log(self, config: EngineConfig) -> None:
        logger.info(
            "cbgen: %d KV blocks of %d tokens (%.1f MiB, %d bytes/token), context limit %d, "
            "cache groups: %s",
            self.num_blocks,
            config.block_size,
            self.num_blocks * config.block_size * self.bytes_per_token / 2**20,
            self.bytes_per_token,
            self.max_model_len,
            "; ".join(g.describe() for g in self.groups),
        )
        if self.state_specs:
            logger.info(
                "cbgen: %d state layers, %d bytes per request, %d slots (max_num_seqs) and "
                "%d prefix-cache checkpoints: %s",
                len(self.state_specs),
                self.state_bytes_per_request,
                config.max_num_seqs,
                self.num_checkpoints,
                "; ".join(s.describe() for s in self.state_specs),
            )


def plan_cache(
    config: EngineConfig,
    model: torch.nn.Module,
    layers: list[LayerSpec],
    state_specs: list[StateSpec],
    device: torch.device,
    draft_bytes_per_token: int = 0,
) -> CachePlan:
    """The plan for ``model`` (its probed attention ``layers`` and ``state_specs``) under
    ``config``; a draft model's cache takes ``draft_bytes_per_token`` from the same
    budget. Raises ``ValueError`` when the budget holds no block."""
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype)
    if kv_dtype is not None:  # the cache's dtype, not the model's
        layers = [replace(spec, dtype=kv_dtype) for spec in layers]
    groups = build_groups(layers)
    per_token = bytes_per_token(tensor_layout(layers, groups)[1])
    state_per_request = state_bytes_per_request(state_specs)
    prefix_off = prefix_caching_unsupported_reason(model.config, groups)
    if not config.enable_prefix_caching:
        prefix_off = prefix_off or "enable_prefix_caching=False"
    # A prefix-cache hit of a state model starts from the state saved after its last
    # cached block: as many such checkpoints as requests run at once.
    num_checkpoints = config.max_num_seqs if state_specs and prefix_off is None else 0
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif per_token == 0:
        # State layers only: blocks are bookkeeping and cost nothing.
        context = min(config.max_model_len or model_context_limit(model) or 1 << 15, 1 << 15)
        num_blocks = config.max_num_seqs * -(-context // config.block_size)
    else:
        # A draft's cache holds as many blocks as the target's, from the same budget.
        # CPU ranks of a tensor-parallel engine share the host's memory: each takes its
        # share of the default budget (an explicit kv_cache_memory is per rank).
        ranks = config.tensor_parallel_size if device.type == "cpu" else 1
        budget = config.kv_cache_memory or default_cache_budget(device) // ranks
        # The state slots (running requests' and checkpoints) come first.
        states = state_per_request * (config.max_num_seqs + num_checkpoints)
        num_blocks = (budget - states) // ((per_token + draft_bytes_per_token) * config.block_size)
        if num_blocks < 1:
            held = f" after {states} bytes of state slots" if states else ""
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block{held}"
                + (" (fewer max_num_seqs need fewer slots)" if states else "")
            )
    # The longest request that fits alone (None: windowed layers only, any length fits).
    cache_limit = max_request_tokens(groups, num_blocks, config.block_size, config.max_batch_tokens)
    model_limit = config.max_model_len or model_context_limit(model) or cache_limit
    if model_limit is None:
        model_limit = 1 << 62
    return CachePlan(
        layers=layers,
        groups=groups,
        bytes_per_token=per_token,
        state_specs=state_specs,
        state_bytes_per_request=state_per_request,
        prefix_caching_off=prefix_off,
        num_checkpoints=num_checkpoints,
        num_blocks=num_blocks,
        max_model_len=model_limit if cache_limit is None else min(model_limit, cache_limit),
    )
