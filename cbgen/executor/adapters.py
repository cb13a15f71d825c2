"""Model adapters: what runs a step's forward pass.

* ``FastDecoder``: the Llama-family decoder run without transformers' module code
  (``cbgen.executor.cpu.fast_forward``), from the chosen linear, layer-ops and attention
  backends. Float32 or bfloat16 on CPU, prepacked linear maps, native layer ops, no hooks, and
  every layer of the expected shape.
* ``HFModules``: the model's own ``forward``; attention reaches the chosen backend
  through transformers' attention interface (``cbgen.executor.attention_hook``). Serves any model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from .attention_hook import attention_context
from .base import LayerOps, LinearBackend, ModelAdapter
from .cpu.fast_forward import DISABLE_ENV, FastForward, Unsupported, plan_fast_forward
from .linear import OneDnnPackedLinear
from .metadata import ProbeRecord

if TYPE_CHECKING:
    from .batch import StepBatch


class FastDecoder(ModelAdapter):
    """The fast decoder path; ``fast_forward`` is the ``FastForward`` once accepted."""

    name = "fast-decoder"

    def __init__(
        self, probe: ProbeRecord, linear: LinearBackend | None, layer_ops: LayerOps | None
    ) -> None:
        self.probe = probe
        self.linear = linear
        self.layer_ops = layer_ops
        self.fast_forward: FastForward | None = None

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        if os.environ.get(DISABLE_ENV) == "1":
            return f"turned off ({DISABLE_ENV}=1)"
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return f"it runs float32 or bfloat16 on CPU and the model is {dtype} on {device.type}"
        if self.layer_ops is None:
            return "it needs the native layer ops (refused: see layer_ops)"
        if not isinstance(self.linear, OneDnnPackedLinear) or self.linear.packed is None:
            return "it needs the oneDNN prepacked linear maps (refused: see linear)"
        try:
            self.fast_forward = plan_fast_forward(
                model, self.linear.packed, self.probe, self.layer_ops
            )
        except Unsupported as reason:
            return str(reason)
        return None

    def forward(self, batch: StepBatch) -> torch.Tensor:
        assert self.fast_forward is not None
        return self.fast_forward(batch)

    def close(self) -> None:
        self.fast_forward = None


class HFModules(ModelAdapter):
    """The model's own ``forward``, its attention routed to cbgen's paged cache."""

    name = "hf-modules"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return None

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.logits_indices.numel() == 0:
            logits_to_keep: int | torch.Tensor = 1  # nothing to sample; keep the LM head tiny
        else:
            logits_to_keep = batch.logits_indices
        with attention_context(batch.attention):
            output = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=logits_to_keep,
            )
        logits = output.logits[0]
        if batch.logits_indices.numel() == 0:
            logits = logits[:0]
        # Sample in float32 whatever the model's dtype: argmax and softmax over a
        # 49k vocabulary are both faster and better behaved there than in bfloat16.
        return logits.float()
