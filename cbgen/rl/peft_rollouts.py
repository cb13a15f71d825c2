"""Rollouts from a ``peft`` (LoRA) model across training steps, on one engine whose packed
base outlives every step: only the adapter is synced.

LoRA training freezes the base model, so what cbgen derives from the base (prepacked
linear maps, the fast decoder's plan, the probe, the KV cache's layout) stays valid from
one step to the next; building it again costs about a second on SmolLM2-135M. Between
rollouts the engine is paused with its copies kept (``EngineCore.pause(keep_weights=
True)``): the model has its own attention implementation and module forwards back, and
its peft wrappers are in place again (``cbgen.rl.peft_target``), so the trainer's
forward and backward are peft's own. At the next rollout the base layers are lent again,
cbgen's forwards put back, and the adapter's weights copied from the live model into its
slot (``update_lora``: milliseconds). Should a base weight change anyway, the engine's
weight-version check notices it on ``resume()`` and rebuilds the executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..core.config import EngineConfig
from ..core.engine_core import EngineCore
from ..sampling.params import SamplingParams
from .peft_target import POLICY, PeftTarget, engine_config
from .rollout import Rollout, rollout


class PeftRollouts:
    """``rollout`` for ``model`` (a ``peft`` model with one active LoRA adapter) on an
    engine built at the first call and kept, paused, between calls until ``close()``
    (or the ``with`` block ends). ``config`` is the engine's (given a LoRA slot of the
    adapter's rank if it has none); ``tokenizer`` as ``EngineCore``'s. The model must
    not be changed in structure between calls (another adapter, a merge)."""

    def __init__(
        self, model: nn.Module, config: EngineConfig | None = None, tokenizer: Any = None
    ) -> None:
        self.target = PeftTarget(model)
        self.config = engine_config(config, self.target)
        self.tokenizer = tokenizer
        self.engine: EngineCore | None = None

    @property
    def model(self) -> nn.Module:
        """The peft model sampled from."""
        return self.target.model

    def rollout(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        num_samples: int = 1,
    ) -> Rollout:
        """``cbgen.rollout`` of the model as it is now (its adapter's current weights),
        on the kept engine; the model is the trainer's again when it returns. After an
        error the engine is closed (the next call builds another)."""
        with self.target.lent() as base:
            try:
                if self.engine is None:
                    self.engine = EngineCore(base, self.config, self.tokenizer)
                    self.engine.add_lora(POLICY, self.target.adapter)
                else:
                    base.eval()  # the trainer's train mode (dropout) is not the policy's
                    self.engine.resume()
                    self.engine.update_lora(POLICY, self.target.adapter)
                samples = rollout(self.engine, prompts, params, num_samples, lora=POLICY)
                self.engine.pause(keep_weights=True)
            except BaseException:
                self.close()
                raise
        return samples

    def close(self) -> None:
        """Close the engine (its packed weights and KV cache freed); idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> PeftRollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
