"""An MoE layer's experts with int8 or 4-bit codes.

transformers 5 keeps a mixture-of-experts layer's experts as 3D parameters of one module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) rather than as ``nn.Linear``
modules, so quantizing the linear maps alone left them in bfloat16: 95% of an
OLMoE-1B-7B's weights, and every byte a decode step reads from them. ``QuantizedExperts``
takes such a module's place, holding each expert's two maps as ``QuantizedLinear``
modules (the same kernels as every other quantized map), and routes tokens as
transformers' eager experts do: each token's rows through its chosen experts, scaled by
its routing weights and summed, expert by expert in ascending order.

Which modules it takes is decided by running them: before an experts module is replaced,
the routing here is checked against the module's own forward on a few tokens with its
own (unquantized) weights. A layer whose experts differ (a custom gate, a norm after
each expert, expert parallelism, weights of other shapes) fails that check and keeps its
float weights, and the log says so: a quantized model never computes something else
than its module would with those codes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .prepack import page_out_files
from .quantization import QuantizedLinear, shape_fits

logger = logging.getLogger(__name__)

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


def route_tokens(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    first: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    down: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    activate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Every token's rows through its ``top_k_index`` experts (``down(activate(first(x)))``
    for each), times its ``top_k_weights``, summed into ``[tokens, hidden]``.

    The token-expert pairs are sorted by expert once, and the gather, the activation,
    the weighting and the sum each run once for all of them: a decode step of one
    token through 8 experts made about 20 small torch calls an expert where only the two
    maps need one each (1.1 ms a layer of overhead on OLMoE). The sum adds the rows in
    ascending expert order, as transformers' eager loop adds them. An index past the
    last expert (expert parallelism's sentinel) contributes nothing."""
    out = torch.zeros_like(hidden_states)
    experts = len(first)
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()[:experts]
    taken = sum(counts)
    if taken == 0:
        return out
    order = order[:taken]  # sentinels sort last
    tokens = torch.div(order, k, rounding_mode="floor")
    rows = hidden_states[tokens]
    spans = [(e, start, count) for e, (start, count) in enumerate(_spans(counts)) if count]
    widened = torch.cat([first[e](rows[start : start + n]) for e, start, n in spans])
    activated = activate(widened)
    outputs = torch.cat([down[e](activated[start : start + n]) for e, start, n in spans])
    weighted = outputs * top_k_weights.reshape(-1)[order, None]
    out.index_add_(0, tokens, weighted.to(out.dtype))
    return out


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """``(start, count)`` of each expert's run of rows in expert order."""
    spans, start = [], 0
    for count in counts:
        spans.append((start, count))
        start += count
    return spans


def _gated(act_fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    gate, up = rows.chunk(2, dim=-1)
    return act_fn(gate) * up


class QuantizedExperts(nn.Module):
    """One MoE layer's experts, each expert's maps a ``QuantizedLinear``.

    Made with ``from_experts``; called as transformers' experts modules are,
    ``(hidden_states [tokens, hidden], top_k_index, top_k_weights) -> [tokens, hidden]``.
    The maps keep the source's names (``gate_up_proj`` or ``up_proj``, ``down_proj``),
    one module per expert, so weight updates by name find them
    (``cbgen.core.weights.load_named_weights``)."""

    def __init__(
        self,
        first_name: str,
        first: list[QuantizedLinear],
        down: list[QuantizedLinear],
        act_fn: nn.Module,
        transposed: bool,
    ) -> None:
        super().__init__()
        self.first_name = first_name
        self.num_experts = len(first)
        self.transposed = transposed  # the source's 3D weights were [E, in, out]
        setattr(self, first_name, nn.ModuleList(first))
        self.down_proj = nn.ModuleList(down)
        self.act_fn = act_fn

    down_proj: nn.ModuleList

    @property
    def first_maps(self) -> nn.ModuleList:
        maps: nn.ModuleList = getattr(self, self.first_name)
        return maps

    @property
    def gated(self) -> bool:
        return self.first_name == "gate_up_proj"

    def activate(self, rows: torch.Tensor) -> torch.Tensor:
        return _gated(self.act_fn, rows) if self.gated else self.act_fn(rows)

    @classmethod
    def from_experts(cls, experts: nn.Module, mode: str, group_size: int = 32) -> QuantizedExperts:
        """``experts`` quantized in ``mode``, or ValueError saying why it cannot be (its
        routing differs from this one's, or its maps' shapes do not fit the kernels)."""
        names = experts_parameters(experts)
        if names is None:
            raise ValueError(f"{type(experts).__name__} does not hold experts as 3D parameters")
        first_name, _ = names
        others = [name for name, _ in experts.named_children() if name != "act_fn"]
        if others:
            raise ValueError(f"{type(experts).__name__} holds modules of its own: {others}")
        if not _default_gate(experts):
            raise ValueError(
                f"{type(experts).__name__} gates its experts its own way (_apply_gate)"
            )
        transposed = bool(getattr(experts, "is_transposed", False))
        act_fn = getattr(experts, "act_fn", None)
        if not isinstance(act_fn, nn.Module):
            raise ValueError(f"{type(experts).__name__} has no activation module (act_fn)")
        first_weight, down_weight = _weight(experts, first_name), _weight(experts, "down_proj")
        for weight in (first_weight, down_weight):
            out_features, in_features = _map_shape(weight, transposed)
            if not shape_fits(out_features, in_features, mode, group_size):
                raise ValueError(
                    f"expert maps of {in_features} -> {out_features} do not fit {mode} "
                    f"kernels (group {group_size})"
                )
        _check_routing(experts, first_name, transposed, act_fn)
        first_bias = _parameter(experts, f"{first_name}_bias")
        down_bias = _parameter(experts, "down_proj_bias")

        def quantized(weight: torch.Tensor, bias: torch.Tensor | None) -> list[QuantizedLinear]:
            return [
                QuantizedLinear.from_weight(
                    _expert_weight(weight, e, transposed),
                    None if bias is None else bias[e],
                    mode,
                    group_size,
                )
                for e in range(weight.shape[0])
            ]

        return cls(
            first_name,
            quantized(first_weight, first_bias),
            quantized(down_weight, down_bias),
            act_fn,
            transposed,
        )

    def expert_weight(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """A 3D weight as transformers holds this layer's (``[E, out, in]``, or ``[E, in,
        out]`` where the source was transposed) as one ``[out, in]`` matrix per expert:
        what a weight update by name requantizes."""
        return [_expert_weight(weight, e, self.transposed) for e in range(weight.shape[0])]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, gated={self.gated}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return route_tokens(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.first_maps,  # type: ignore[arg-type]
            self.down_proj,  # type: ignore[arg-type]
            self.activate,
        )


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


def _map_shape(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """``(out, in)`` of each expert's map in a 3D ``weight``."""
    rows, columns = weight.shape[1], weight.shape[2]
    return (columns, rows) if transposed else (rows, columns)


def _expert_weight(weight: torch.Tensor, expert: int, transposed: bool) -> torch.Tensor:
    one = weight.detach()[expert]
    return one.t() if transposed else one


def _check_routing(
    experts: nn.Module, first_name: str, transposed: bool, act_fn: nn.Module
) -> None:
    """Refuse (ValueError) an experts module whose own forward, on a few tokens routed at
    random, differs from ``route_tokens`` over its own float weights."""
    first_weight, down_weight = _weight(experts, first_name), _weight(experts, "down_proj")
    first_bias = _parameter(experts, f"{first_name}_bias")
    down_bias = _parameter(experts, "down_proj_bias")
    num_experts, hidden = first_weight.shape[0], _map_shape(first_weight, transposed)[1]
    generator = torch.Generator().manual_seed(0)
    tokens, k = 5, min(2, num_experts)
    dtype = first_weight.dtype
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    index = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)]
    )
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1).to(dtype)

    def maps(weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        return [
            functools.partial(
                _float_map,
                weight=_expert_weight(weight, e, transposed),
                bias=None if bias is None else bias[e],
            )
            for e in range(num_experts)
        ]

    gated = first_name == "gate_up_proj"

    def activate(rows: torch.Tensor) -> torch.Tensor:
        return _gated(act_fn, rows) if gated else act_fn(rows)

    try:
        with torch.no_grad():
            want = experts(x, index, weights)
            got = route_tokens(
                x,
                index,
                weights,
                maps(first_weight, first_bias),
                maps(down_weight, down_bias),
                activate,
            )
    except Exception as failure:  # the module's forward takes other arguments, or shapes
        raise ValueError(
            f"{type(experts).__name__}: its forward did not run here ({failure})"
        ) from failure
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise ValueError(f"{type(experts).__name__}: its forward returns something else")
    scale = float(want.float().abs().max().clamp(min=1e-6))
    error = float((got.float() - want.float()).abs().max()) / scale
    if error > _CHECK_TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE):
        raise ValueError(
            f"{type(experts).__name__} computes something else than plain routed experts "
            f"(relative difference {error:.2g}): a custom gate or a norm after each expert"
        )


def _float_map(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def quantize_experts(
    model: nn.Module, mode: str, group_size: int, done: Callable[[torch.Tensor], object]
) -> tuple[int, list[str]]:
    """Replace every experts module of ``model`` that passes the check by a
    ``QuantizedExperts``; ``done(weight)`` is called on each source weight once its codes
    are made (to drop its file pages). Returns how many were replaced and, for the rest,
    ``"name: why"``."""
    replaced = 0
    kept: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if experts_parameters(child) is None:
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if any(p.device.type != "cpu" for p in child.parameters()):
                kept.append(f"{full}: not on the CPU")
                continue
            try:
                quantized = QuantizedExperts.from_experts(child, mode, group_size)
            except ValueError as error:
                kept.append(f"{full}: {error}")
                continue
            setattr(parent, name, quantized)
            replaced += 1
            for weight in child.parameters(recurse=False):
                done(weight.detach())
    return replaced, kept


@contextlib.contextmanager
def quantizing_experts_as_loaded(mode: str | None, group_size: int = 32) -> Iterator[None]:
    """While transformers loads a model in this block, each experts module is quantized
    as soon as its weights are in, and the checkpoint's file pages read so far are let
    go (``mode`` None: only that, the experts stay in the loaded dtype).

    transformers stacks a checkpoint's per-expert matrices into new 3D tensors as it
    loads, so a model's experts were all in memory in bfloat16 before quantizing began:
    an OLMoE-1B-7B peaked at 23 GiB loading to int4 (13 GB of experts, and the file's
    pages read to make them), past what its 3.9 GB of codes need. The hook wraps
    transformers' ``core_model_loading.set_param_for_module`` for the block; where that
    function is missing (another transformers version) nothing is wrapped and
    ``quantize_model`` quantizes the experts after loading, as before. Not for two loads
    at once in threads."""
    try:
        from transformers import core_model_loading as loading
    except ImportError:
        yield
        return
    original = getattr(loading, "set_param_for_module", None)
    if original is None:
        yield
        return

    def set_param_for_module(model: nn.Module, target_name: str, *args: Any, **kwargs: Any) -> Any:
        result = original(model, target_name, *args, **kwargs)
        _quantize_when_loaded(model, target_name.rpartition(".")[0], mode, group_size)
        return result

    loading.set_param_for_module = set_param_for_module
    try:
        yield
    finally:
        loading.set_param_for_module = original


def _quantize_when_loaded(model: nn.Module, path: str, mode: str | None, group_size: int) -> None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return
    if experts_parameters(module) is None:
        return
    own = list(module.parameters(recurse=False))
    if any(p.is_meta or p.device.type != "cpu" for p in own):
        return  # not all in yet (or not for the CPU kernels)
    if mode is None:
        page_out_files(".safetensors")  # the stacked copies are made; the file pages can go
        return
    try:
        quantized = QuantizedExperts.from_experts(module, mode, group_size)
    except ValueError:
        return  # quantize_model tries again after loading, and logs why it cannot
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, quantized)
    for weight in own:  # transformers' own references go when it moves on
        weight.data = torch.empty(0, dtype=weight.dtype)
    page_out_files(".safetensors")
