"""Prepacked float32 linear maps on CPU (oneDNN), applied to a model for an engine's lifetime.

On CPU ``F.linear`` hands every call to a GEMM that re-reads the weight in its
row-major layout; oneDNN can reorder a weight once into the blocked layout its
kernels read fastest. For the bundled SmolLM2 at 64 decode rows and one thread
this took the decoder layers' linear maps from about 262 to 219 ms a step and
the LM head (49152 x 576) from about 106 to 48 ms, and a whole decode step from
about 440 to 320 ms (``bench/micro_step.py --compare no-prepack,prepack``).

The transform overrides ``forward`` on each ``nn.Linear`` instance (so module
identity, hooks on parents and ``state_dict`` are untouched) and keeps the
packed copy beside the original weight, which stays in place: ``restore()``
just drops the overrides. The cost is a second copy of the packed weights
(about 570 MB for SmolLM2 in float32, LM head included).

Outputs differ from ``F.linear`` by float32 rounding (the sums run in another
order), which is the same kind of difference batching already makes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DISABLE_ENV = "CBGEN_NO_PREPACK"


def prepack_supported() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops (CPU builds with mkldnn)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_forward(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        # The packed op wants a float32, CPU, non-empty input without autograd;
        # anything else (an empty batch, a training call) takes the plain path.
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return F.linear(x, weight, bias)
        return linear_pointwise(x, packed, bias, "none", [], "")

    return forward


class PackedLinears:
    """The ``nn.Linear`` modules of a model switched to oneDNN prepacked weights.

    Only float32 CPU modules are packed; others are left alone. ``restore()``
    (idempotent) gives every module its own ``forward`` back.
    """

    def __init__(self, model: nn.Module, batch_size_hint: int = 64) -> None:
        self._modules: list[nn.Linear] = []
        if not prepack_supported():
            return
        for module in model.modules():
            if not isinstance(module, nn.Linear) or "forward" in module.__dict__:
                continue  # already overridden (by us or someone else): leave it
            weight = module.weight
            if weight.dtype != torch.float32 or weight.device.type != "cpu":
                continue
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
            bias = module.bias.detach() if module.bias is not None else None
            module.forward = _packed_forward(weight, packed, bias)  # type: ignore[method-assign]
            self._modules.append(module)

    def __len__(self) -> int:
        return len(self._modules)

    def restore(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules = []


def prepack_enabled_by_default(model: nn.Module) -> bool:
    """On for float32 models on CPU, unless ``CBGEN_NO_PREPACK=1``."""
    if os.environ.get(DISABLE_ENV) == "1" or not prepack_supported():
        return False
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return param.device.type == "cpu" and param.dtype == torch.float32
