"""An MoE layer's experts with int8 or 4-bit codes.

transformers 5 keeps a mixture-of-experts layer's experts as 3D parameters of one module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) rather than as ``nn.Linear``
modules, so quantizing the linear maps alone left them in bfloat16: 95% of an
OLMoE-1B-7B's weights, and every byte a decode step reads from them. ``QuantizedExperts``
takes such a module's place, holding each expert's two maps as ``QuantizedLinear``
modules (the same kernels as every other quantized map), and routes tokens as
transformers' eager experts do (``routed_experts.route_tokens``).

Which modules it takes is decided by running them (``routed_experts.routed_form``): a
layer whose experts differ from plain routed experts keeps its float weights, and the
log says so: a quantized model never computes something else than its module would
with those codes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .prepack import page_out_files
from .quantization import Int4Map, QuantizedLinear, shape_fits
from .routed_experts import (
    RoutedForm,
    experts_parameters,
    map_shape,
    per_expert,
    route_tokens,
    routed_form,
)

logger = logging.getLogger(__name__)


class QuantizedExperts(nn.Module):
    """One MoE layer's experts, each expert's maps a ``QuantizedLinear``.

    Made with ``from_experts``; called as transformers' experts modules are,
    ``(hidden_states [tokens, hidden], top_k_index, top_k_weights) -> [tokens, hidden]``.
    The maps keep the source's names (``gate_up_proj`` or ``up_proj``, ``down_proj``),
    one module per expert, so weight updates by name find them
    (``cbgen.core.weights.load_named_weights``)."""

    def __init__(
        self, form: RoutedForm, first: list[QuantizedLinear], down: list[QuantizedLinear]
    ) -> None:
        super().__init__()
        self.num_experts = len(first)
        self._form = form.without_weights()  # names, layout and activation
        setattr(self, form.first_name, nn.ModuleList(first))
        self.down_proj = nn.ModuleList(down)
        self.act_fn = form.act_fn

    down_proj: nn.ModuleList

    @property
    def first_name(self) -> str:
        """``"gate_up_proj"`` (gated experts) or ``"up_proj"``, as the source named it."""
        return self._form.first_name

    @property
    def first_maps(self) -> nn.ModuleList:
        maps: nn.ModuleList = getattr(self, self.first_name)
        return maps

    @property
    def gated(self) -> bool:
        return self._form.gated

    def activate(self, rows: torch.Tensor) -> torch.Tensor:
        return self._form.activate(rows)

    @classmethod
    def from_experts(cls, experts: nn.Module, mode: str, group_size: int = 32) -> QuantizedExperts:
        """``experts`` quantized in ``mode``, or ValueError saying why it cannot be (its
        routing differs from this one's, or its maps' shapes do not fit the kernels)."""
        form = routed_form(experts)
        for weight in (form.first_weight, form.down_weight):
            out_features, in_features = map_shape(weight, form.transposed)
            if not shape_fits(out_features, in_features, mode, group_size):
                raise ValueError(
                    f"expert maps of {in_features} -> {out_features} do not fit {mode} "
                    f"kernels (group {group_size})"
                )

        def quantized(weight: torch.Tensor, bias: torch.Tensor | None) -> list[QuantizedLinear]:
            return [
                QuantizedLinear.from_weight(
                    one, None if bias is None else bias[e], mode, group_size
                )
                for e, one in enumerate(form.expert_weights(weight))
            ]

        return cls(
            form,
            quantized(form.first_weight, form.first_bias),
            quantized(form.down_weight, form.down_bias),
        )

    def expert_weight(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """A 3D weight as transformers holds this layer's (``[E, out, in]``, or ``[E, in,
        out]`` where the source was transposed) as one ``[out, in]`` matrix per expert:
        what a weight update by name requantizes."""
        return self._form.expert_weights(weight)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, gated={self.gated}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return route_tokens(
            hidden_states,
            top_k_index,
            top_k_weights,
            functools.partial(_spans_through, self.first_maps),
            functools.partial(_spans_through, self.down_proj),
            self.activate,
            self.num_experts,
        )


def _spans_through(
    maps: nn.ModuleList, rows: torch.Tensor, experts: list[int], counts: list[int]
) -> torch.Tensor:
    """Spans of rows through their experts' quantized maps: one native call for all of
    them where each is a plain map on one of cbgen's 4-bit kernels (``int4_grouped``),
    else one call a span."""
    modules: list[QuantizedLinear] = [maps[e] for e in experts]  # type: ignore[misc]
    kernels = [m.kernel() for m in modules]
    first: Any = kernels[0]
    if rows.dtype is torch.bfloat16 and all(grouped_int4(m, first) for m in kernels):
        return first.native.int4_grouped(  # type: ignore[no-any-return]
            rows.contiguous(),
            counts,
            [m.packed for m in kernels],  # type: ignore[attr-defined]
            [m.scales_minima for m in kernels],  # type: ignore[attr-defined]
            first.path,
        )
    return per_expert(kernels)(rows, list(range(len(kernels))), counts)


def grouped_int4(linear_map: object, first: Any) -> bool:
    """A plain map on the same native 4-bit kernel as ``first`` (``int4_grouped`` takes
    them in one call)."""
    return (
        isinstance(linear_map, Int4Map)
        and linear_map.path in _GROUPED_PATHS
        and linear_map.path == first.path
        and linear_map.bias is None
        and linear_map.lora is None
    )


_GROUPED_PATHS = ("avx2", "bf16", "vnni")  # int4_grouped's; "torch" is torch's kernel


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
