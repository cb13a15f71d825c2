"""What a state layer's own code is handed for one call: its requests' states, in the
shape transformers' code reads them (a one-layer ``Cache`` of ``LinearAttentionLayer``,
or MiniMax's linear cache), and its per-token arguments cut to the call's rows.

``StateMixers`` (``cbgen.executor.state_mixers``) decides the calls; this module only
moves states in and out of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..cache.state import StateSpec, StateTensorSpec
from .metadata import SlotSet

PROBE_STATES = 8  # state slots offered to a module during the probe


class LinearCache:
    """What MiniMax's lightning attention reads and writes its state through."""

    def __init__(self, value: torch.Tensor | None) -> None:
        self.value = value

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.value

    def set_linear_cache(self, layer_idx: int, value: torch.Tensor) -> None:
        self.value = value


class ProbeState:
    """A fresh state for a probe call; afterwards, the specs of what the module kept."""

    def __init__(self) -> None:
        self.layer: Any = None
        self.linear: LinearCache | None = None

    def handle(self, protocol: str) -> Any:
        if protocol == "linear":
            self.linear = LinearCache(None)
            return self.linear
        self.layer = _new_layer(PROBE_STATES)
        return self.layer

    def specs(self) -> list[StateTensorSpec]:
        if self.linear is not None:
            value = self.linear.value
            if value is None:
                return []
            return [StateTensorSpec("linear", 0, tuple(value.shape[1:]), value.dtype)]
        layer, found = self.layer, []
        for i in range(PROBE_STATES):
            if layer.is_conv_states_initialized[i]:
                conv = layer.conv_states[i]
                kernel = layer.conv_kernel_size[i]
                found.append(StateTensorSpec("conv", i, tuple(conv.shape[1:]), conv.dtype, kernel))
            if layer.is_recurrent_states_initialized[i]:
                rec = layer.recurrent_states[i]
                found.append(StateTensorSpec("recurrent", i, tuple(rec.shape[1:]), rec.dtype))
        return found


class SlotState:
    """The states of some slots for one call: read when the requests continue (else left
    empty, so the module starts from zeros), written back after. Consecutive slots are
    handed over as views, which the module's in-place updates write straight into."""

    def __init__(
        self, spec: StateSpec, tensors: list[torch.Tensor], slots: SlotSet, continues: bool
    ) -> None:
        self.spec, self.tensors, self.slots, self.continues = spec, tensors, slots, continues
        self.layer: Any = None
        self.linear: LinearCache | None = None

    def _slots_of(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.slots.first is not None:
            return tensor.narrow(0, self.slots.first, len(self.slots))
        return tensor.index_select(0, self.slots.ids)

    def handle(self, protocol: str) -> Any:
        values = [self._slots_of(t) for t in self.tensors] if self.continues else None
        if protocol == "linear":
            self.linear = LinearCache(values[0] if values is not None else None)
            return self.linear
        layer = self.layer = _new_layer(max(t.index for t in self.spec.tensors) + 1)
        for t, value in zip(self.spec.tensors, values or [], strict=False):
            if t.kind == "conv":
                layer.conv_states[t.index] = value
                layer.is_conv_states_initialized[t.index] = True
                layer.conv_kernel_size[t.index] = t.conv_kernel
            else:
                layer.recurrent_states[t.index] = value
                layer.is_recurrent_states_initialized[t.index] = True
            layer.has_previous_state[t.index] = True
            layer.device, layer.dtype = value.device, value.dtype
        return layer

    def write_back(self, name: str) -> None:
        for t, tensor in zip(self.spec.tensors, self.tensors, strict=True):
            if self.linear is not None:
                value = self.linear.value
            else:
                held = self.layer.conv_states if t.kind == "conv" else self.layer.recurrent_states
                value = held[t.index]
            if value is None:
                raise RuntimeError(f"{name} kept no {t.kind} state {t.index} this step")
            if self.slots.first is None:
                tensor.index_copy_(0, self.slots.ids, value.to(tensor.dtype))
                continue
            target = tensor.narrow(0, self.slots.first, len(self.slots))
            if value.data_ptr() != target.data_ptr() or value.stride() != target.stride():
                target.copy_(value)  # else the module updated the view in place


def holds_tensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def per_token(value: Any, rows: int) -> bool:
    """A tensor of ``[1, rows, ...]`` (or a tuple of them): one value per packed row."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(per_token(v, rows) for v in value)
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, rows)


def split_rows(
    kwargs: dict[str, Any], rows: int, pick: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """``kwargs`` with every per-token value cut to the rows ``pick`` takes."""
    out = {}
    for name, value in kwargs.items():
        if per_token(value, rows):
            value = (
                type(value)(pick(v) for v in value)
                if isinstance(value, (tuple, list))
                else pick(value)
            )
        out[name] = value
    return out


def rows_of(start: int, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[:, start : start + length]

    return pick


def first_output(result: Any) -> Any:
    """The module's output tensor (MiniMax's lightning attention returns a tuple)."""
    return result[0] if isinstance(result, tuple) else result


def like_module_output(out: torch.Tensor, protocol: str) -> Any:
    # MiniMax's decoder layer unpacks ``(output, weights)``; the others take the tensor.
    return (out, None) if protocol == "linear" else out


def _new_layer(number_of_states: int) -> Any:
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer(number_of_states=number_of_states)


def one_layer_cache(layer_idx: int, layer: Any) -> Any:
    """A transformers ``Cache`` whose layer ``layer_idx`` is ``layer`` (the others hold
    nothing): the module's own code reads and writes its state through the real API."""
    from transformers.cache_utils import Cache

    return Cache(layers=[_filler()] * layer_idx + [layer])


@functools.cache
def _filler() -> Any:
    """What stands for the layers a one-layer cache does not hold: transformers'
    ``DummyLayer`` (5.23), or nothing where it has none (5.17 only indexes the layer
    asked for)."""
    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:
        return None
    return DummyLayer()
