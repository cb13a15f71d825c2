"""A mixture of experts' block as the fast decoder runs it.

The fast decoder (``fast_forward``) calls an MoE block whole by default: the model's
router, then its experts module (``QuantizedExperts`` once quantized), which routes the
tokens with a dozen torch calls around the two grouped 4-bit maps and picks each hit
expert's codes in Python. On one OLMoE-1B-7B stream that glue cost about a fifth of a
layer's experts, in each of its 16 layers.

``NativeExpertsBlock`` keeps the model's own router (so every token goes to the experts
the model picks, with its weights) and runs the experts in one native call
(``routed_int4_experts`` in ``kernels/routed_experts.cpp``) over the codes of every
expert, gathered once when the fast decoder is planned. It computes what
``QuantizedExperts`` computes with the fast decoder's roundings: ``silu(gate) * up``
rounded once, and the weighted sum in float32, added to the float32 residual stream.

It takes blocks whose forward is exactly "router, then experts" (``PLAIN_BLOCKS``: a
shared expert, as Qwen2-MoE's, is more), SiLU-gated experts on one of cbgen's native
4-bit kernel paths, and, decided by running it, a block whose own forward agrees with it
on a few tokens. Anything else is called whole, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .quantization import QuantizedLinear
from .quantized_experts import QuantizedExperts, grouped_int4
from .routed_experts import relative_difference

logger = logging.getLogger(__name__)

# transformers 5's MoE blocks whose forward is ``experts(x, *reversed(gate(x)[1:]))``
# (Mixtral's router jitter applies in training only, and is refused).
PLAIN_BLOCKS = frozenset({"MixtralSparseMoeBlock", "OlmoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock"})
_SILU = ("SiLU", "SiLUActivation")
# The check's relative tolerance: the block's own bfloat16 path rounds the weighted rows
# and each partial sum, this one does not; a block that computes more is off by far more.
_CHECK_TOLERANCE = 3e-2

MoeCall = Callable[[torch.Tensor], torch.Tensor]  # [tokens, hidden] -> [tokens, hidden]
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class NativeExpertsBlock:
    """Callable on ``[tokens, hidden]`` bfloat16; returns the block's float32 output.

    ``router`` is the block's (``x -> (logits, weights, index)``); ``experts`` must be on
    one native 4-bit kernel path (``moe_call`` checks)."""

    def __init__(self, router: Router | None, experts: QuantizedExperts) -> None:
        kernels = _kernels(experts)
        first, down = kernels[: experts.num_experts], kernels[experts.num_experts :]
        self._router = router
        self._op = kernels[0].native.routed_int4_experts
        self._first = ([k.packed for k in first], [k.scales_minima for k in first])
        self._down = ([k.packed for k in down], [k.scales_minima for k in down])
        self._path: str = kernels[0].path
        self._intermediate = int(first[0].out_features) // 2
        self.hidden = int(down[0].out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self._router is not None
        _, weights, index = self._router(x)
        return self.experts(x, index, weights)

    def experts(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' float32 sum for tokens routed to ``index`` with ``weights``."""
        out: torch.Tensor = self._op(
            x, index, weights, *self._first, *self._down, self._path, self._intermediate
        )
        return out


def whole_block(block: nn.Module) -> MoeCall:
    """The block called as the model calls it (``[1, tokens, hidden]``)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = block(x[None])
        return out.view(x.shape[0], -1)

    return run


def moe_call(block: nn.Module) -> MoeCall:
    """How the fast decoder runs ``block``: a ``NativeExpertsBlock`` where it qualifies,
    else the block whole."""
    reason = _refusal(block)
    if reason is None:
        experts = block.get_submodule("experts")
        assert isinstance(experts, QuantizedExperts)
        native = NativeExpertsBlock(block.get_submodule("gate"), experts)
        reason = _check(block, native)
        if reason is None:
            return native
    logger.debug("cbgen: %s runs whole: %s", type(block).__name__, reason)
    return whole_block(block)


def _kernels(experts: QuantizedExperts) -> list[Any]:
    """Every expert's gate/up kernel, then every expert's down kernel."""
    maps: list[QuantizedLinear] = [*experts.first_maps, *experts.down_proj]  # type: ignore[list-item]
    return [m.kernel() for m in maps]


def _refusal(block: nn.Module) -> str | None:
    """Why ``block`` cannot be a ``NativeExpertsBlock``, or None."""
    name = type(block).__name__
    if name not in PLAIN_BLOCKS:
        return f"{name} is not one of {sorted(PLAIN_BLOCKS)}"
    jitter = getattr(block, "jitter_noise", 0.0)
    if block.training and jitter:
        return "it adds router jitter (training)"
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    if not isinstance(experts, QuantizedExperts):
        return "its experts are not quantized"
    if not experts.gated or type(experts.act_fn).__name__ not in _SILU:
        return "its experts are not SiLU-gated"
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype is not torch.bfloat16:
        return "its router holds no bfloat16 weight"
    kernels = _kernels(experts)
    if not all(grouped_int4(k, kernels[0]) for k in kernels):
        return "its expert maps are not all on one native 4-bit kernel path"
    if not hasattr(kernels[0].native, "routed_int4_experts"):
        return "the built kernels have no routed_int4_experts"
    return None


def _check(block: nn.Module, native: NativeExpertsBlock) -> str | None:
    """None if ``native`` gives the block's own output on a few tokens, else why not."""
    hidden = native.hidden
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=generator).to(torch.bfloat16)
    try:
        with torch.no_grad():
            want = block(x[None]).view(5, hidden)
            got = native(x)
    except Exception as failure:  # a router of another form (another transformers version)
        return f"it did not run as router and experts here ({failure})"
    error = relative_difference(got, want)
    if error > _CHECK_TOLERANCE:
        return (
            f"its forward computes more than router and experts (relative difference {error:.2g})"
        )
    return None
