"""What the engine reads off a model's configs: how long a context it takes, and the
tokens ``model.generate()`` stops on (the sampler, the grammars and the output
processor must agree with it on both)."""

from __future__ import annotations

import torch


def model_context_limit(model: torch.nn.Module) -> int | None:
    """The context length the model's config declares, or None when it names none."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_eos_ids(model: torch.nn.Module) -> set[int]:
    """The ids ``model.generate()`` stops on: the generation config's, else the model config's."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
