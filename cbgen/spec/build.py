"""Which proposer a ``SpeculativeConfig`` asks for, and the draft model it runs: prompt
lookup needs none, ``"draft"`` takes the user's, ``"layer_skip"`` the target's first
layers (copied before the target's executor changes its modules)."""

from __future__ import annotations

import torch

from .draft import DraftModelProposer, layer_skip_model
from .speculative import NgramProposer, Proposer, SpeculativeConfig


def draft_model_for(
    spec: SpeculativeConfig | None, model: torch.nn.Module
) -> torch.nn.Module | None:
    """The draft model ``spec`` names for target ``model``; raises ``ValueError`` when the
    user's draft is the target itself or on another device."""
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return layer_skip_model(model, spec.num_layers)
    draft: torch.nn.Module = spec.draft_model
    if draft is model:
        raise ValueError("draft_model is the target itself; use method='layer_skip'")
    target_device = next(model.parameters()).device
    draft_device = next(draft.parameters()).device
    if draft_device != target_device:
        raise ValueError(
            f"draft_model is on {draft_device} and the target on {target_device}; "
            "put them on the same device"
        )
    return draft


def make_proposer(
    spec: SpeculativeConfig,
    draft_model: torch.nn.Module | None,
    *,
    vocab_size: int,
    max_batch_tokens: int,
    use_native_kernels: bool,
    prepack_linear: bool | None,
) -> Proposer:
    """Prompt lookup without a draft model, else a proposer running ``draft_model`` on an
    executor and KV cache of its own (the cache is allocated later, with the target's)."""
    if draft_model is None:
        return NgramProposer(spec.num_tokens, adaptive=spec.adaptive)
    return DraftModelProposer(
        draft_model,
        spec.num_tokens,
        vocab_size=vocab_size,
        max_batch_tokens=max_batch_tokens,
        use_native_kernels=use_native_kernels,
        prepack_linear=prepack_linear,
        adaptive=spec.adaptive,
    )
