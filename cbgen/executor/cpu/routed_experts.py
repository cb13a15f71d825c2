"""transformers 5's MoE experts modules, and routing tokens through experts.

transformers 5 keeps a mixture-of-experts layer's experts as 3D parameters of one module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) rather than as ``nn.Linear``
modules, and runs them with its own loops (``eager``) or grouped GEMMs. cbgen runs them
through its own maps instead (``quantized_experts`` for int8 and 4-bit codes,
``prepack.PackedLinears`` for plain bfloat16 weights on CPUs whose oneDNN packs none),
routing tokens as transformers' eager experts do: each token's rows through its chosen
experts, scaled by its routing weights and summed, expert by expert in ascending order.

Which modules that may replace is decided by running them: ``routed_form`` checks the
routing here against the module's own forward on a few tokens with its own weights. A
layer whose experts differ (a custom gate, a norm after each expert, expert
parallelism, weights of other shapes) fails that check and keeps its own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The parameter names of transformers 5's experts modules (``use_experts_implementation``):
# gated experts hold ``gate_up_proj``, ungated ones ``up_proj``; biases are optional.
_FIRST_MAPS = ("gate_up_proj", "up_proj")
_KNOWN_PARAMETERS = {
    "gate_up_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "up_proj_bias",
    "down_proj_bias",
}

# Relative error (largest difference over largest magnitude) the self-check allows between
# the routing here and the module's own forward, by the weights' dtype: the two sum the
# same products, in whatever order their GEMMs take; a different computation is off by
# order one.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
_LOW_PRECISION_TOLERANCE = 3e-2


def experts_parameters(module: nn.Module) -> tuple[str, str] | None:
    """``(first map's name, "down_proj")`` if ``module`` holds experts as transformers 5
    does (3D parameters, nothing else), else None."""
    own = dict(module.named_parameters(recurse=False))
    if not own or set(own) - _KNOWN_PARAMETERS or "down_proj" not in own:
        return None
    first = next((name for name in _FIRST_MAPS if name in own), None)
    if first is None or own[first].dim() != 3 or own["down_proj"].dim() != 3:
        return None
    return first, "down_proj"


# Runs consecutive spans of rows, each through one expert's map: ``(rows, experts,
# counts) -> outputs``, with ``experts`` ascending and ``counts`` (all positive) adding up
# to the rows. ``per_expert`` makes one of a list of maps.
SpanMaps = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def per_expert(maps: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> SpanMaps:
    """Spans through ``maps[expert]`` one call a span."""

    def run(rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        pieces, start = [], 0
        for expert, count in zip(experts, counts, strict=True):
            pieces.append(maps[expert](rows[start : start + count]))
            start += count
        return torch.cat(pieces)

    return run


def route_tokens(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    first: SpanMaps,
    down: SpanMaps,
    activate: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """Every token's rows through its ``top_k_index`` experts (``down(activate(first(x)))``
    for each), times its ``top_k_weights``, summed into ``[tokens, hidden]``.

    The token-expert pairs are sorted by expert once, and the gather, the activation,
    the weighting and the sum each run once for all of them: a decode step of one
    token through 8 experts made about 20 small torch calls an expert where only the two
    maps need one each (1.1 ms a layer of overhead on OLMoE), and the maps may take all
    spans in one call (``first``, ``down``). The sum adds the rows in ascending expert
    order, as transformers' eager loop adds them. An index past the last expert (expert
    parallelism's sentinel) contributes nothing."""
    out = torch.zeros_like(hidden_states)
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    taken = sum(counts)
    if taken == 0:
        return out
    order = order[:taken]  # sentinels sort last
    tokens = torch.div(order, k, rounding_mode="floor")
    rows = hidden_states[tokens]
    experts = [e for e, count in enumerate(counts) if count]
    sizes = [counts[e] for e in experts]
    outputs = down(activate(first(rows, experts, sizes)), experts, sizes)
    weighted = outputs * top_k_weights.reshape(-1)[order, None]
    out.index_add_(0, tokens, weighted.to(out.dtype))
    return out


def _gated(act_fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    gate, up = rows.chunk(2, dim=-1)
    return act_fn(gate) * up


@dataclass(frozen=True)
class RoutedForm:
    """An experts module that routes as ``route_tokens`` does: its weights and activation."""

    first_name: str  # "gate_up_proj" (gated) or "up_proj"
    first_weight: torch.Tensor  # 3D, as the module holds it
    down_weight: torch.Tensor
    first_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act_fn: nn.Module
    transposed: bool  # weights held [E, in, out]

    @property
    def num_experts(self) -> int:
        return int(self.first_weight.shape[0])

    @property
    def gated(self) -> bool:
        return self.first_name == "gate_up_proj"

    def activate(self, rows: torch.Tensor) -> torch.Tensor:
        return _gated(self.act_fn, rows) if self.gated else self.act_fn(rows)

    def expert_weights(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """A 3D weight as one ``[out, in]`` matrix per expert (views)."""
        return [_expert_weight(weight, e, self.transposed) for e in range(weight.shape[0])]

    def without_weights(self) -> RoutedForm:
        """The form without its tensors (for a module that keeps its own copies of them,
        so the source's are not held alive)."""
        empty = torch.empty(0, 0, 0)
        return RoutedForm(self.first_name, empty, empty, None, None, self.act_fn, self.transposed)


def routed_form(experts: nn.Module) -> RoutedForm:
    """``experts`` as a ``RoutedForm``, or ValueError saying why its forward is not plain
    routed experts."""
    names = experts_parameters(experts)
    if names is None:
        raise ValueError(f"{type(experts).__name__} does not hold experts as 3D parameters")
    first_name, _ = names
    others = [name for name, _ in experts.named_children() if name != "act_fn"]
    if others:
        raise ValueError(f"{type(experts).__name__} holds modules of its own: {others}")
    if not _default_gate(experts):
        raise ValueError(f"{type(experts).__name__} gates its experts its own way (_apply_gate)")
    act_fn = getattr(experts, "act_fn", None)
    if not isinstance(act_fn, nn.Module):
        raise ValueError(f"{type(experts).__name__} has no activation module (act_fn)")
    form = RoutedForm(
        first_name,
        _weight(experts, first_name),
        _weight(experts, "down_proj"),
        _parameter(experts, f"{first_name}_bias"),
        _parameter(experts, "down_proj_bias"),
        act_fn,
        bool(getattr(experts, "is_transposed", False)),
    )
    _check_routing(experts, form)
    return form


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of ``want``: what the checks that
    run a module against cbgen's own computation of it compare with their tolerance."""
    scale = float(want.float().abs().max().clamp(min=1e-6))
    return float((got.float() - want.float()).abs().max()) / scale


def map_shape(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """``(out, in)`` of each expert's map in a 3D ``weight``."""
    rows, columns = weight.shape[1], weight.shape[2]
    return (columns, rows) if transposed else (rows, columns)


def _default_gate(experts: nn.Module) -> bool:
    """Whether ``experts`` gates as transformers' default does (``act_fn(gate) * up``).
    A gate of its own (gpt-oss's and DeepSeek-V4's clamp their inputs) may agree with it
    on the check's few tokens and not on a real model's larger activations, so it is
    refused by name rather than trusted to the check."""
    gate = getattr(type(experts), "_apply_gate", None)
    return gate is None or (
        getattr(gate, "__module__", "") == "transformers.integrations.moe"
        and getattr(gate, "__name__", "") == "_default_apply_gate"
    )


def _parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    tensor = module._parameters.get(name)
    return None if tensor is None else tensor.detach()


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    tensor = _parameter(module, name)
    assert tensor is not None, name  # experts_parameters found it
    return tensor


def _expert_weight(weight: torch.Tensor, expert: int, transposed: bool) -> torch.Tensor:
    one = weight.detach()[expert]
    return one.t() if transposed else one


def _check_routing(experts: nn.Module, form: RoutedForm) -> None:
    """Refuse (ValueError) an experts module whose own forward, on a few tokens routed at
    random, differs from ``route_tokens`` over its own float weights."""
    num_experts = form.num_experts
    hidden = map_shape(form.first_weight, form.transposed)[1]
    generator = torch.Generator().manual_seed(0)
    tokens, k = 5, min(2, num_experts)
    dtype = form.first_weight.dtype
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    index = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)]
    )
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1).to(dtype)

    def maps(weight: torch.Tensor, bias: torch.Tensor | None) -> SpanMaps:
        return per_expert(
            [
                functools.partial(F.linear, weight=one, bias=None if bias is None else bias[e])
                for e, one in enumerate(form.expert_weights(weight))
            ]
        )

    try:
        with torch.no_grad():
            want = experts(x, index, weights)
            got = route_tokens(
                x,
                index,
                weights,
                maps(form.first_weight, form.first_bias),
                maps(form.down_weight, form.down_bias),
                form.activate,
                num_experts,
            )
    except Exception as failure:  # the module's forward takes other arguments, or shapes
        raise ValueError(
            f"{type(experts).__name__}: its forward did not run here ({failure})"
        ) from failure
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise ValueError(f"{type(experts).__name__}: its forward returns something else")
    error = relative_difference(got, want)
    if error > _CHECK_TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE):
        raise ValueError(
            f"{type(experts).__name__} computes something else than plain routed experts "
            f"(relative difference {error:.2g}): a custom gate or a norm after each expert"
        )
