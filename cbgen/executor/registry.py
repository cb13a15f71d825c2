"""Which backend serves each role: ordered candidates, the first that ``supports`` wins.

Roles are chosen in ``ROLES`` order, so a later role's candidates can depend on
the earlier choices (the fast decoder needs the prepacked linear maps and the
native layer ops). A role whose every candidate refuses is served by nothing
(``layer_ops`` on anything but float32 CPU: only the fast decoder uses it).

New backends (a CUDA paged-attention kernel, bf16 or int8 linear maps) join
with ``register(role, factory, first=True)``; a factory takes the
``BuildContext`` and returns a backend, which is then asked ``supports``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters import FastDecoder, HFModules
from .attention import NativeCpuAttention, TorchReferenceAttention
from .base import Backend, LayerOps, LinearBackend
from .greedy import NativeArgmax, TorchArgmax
from .linear import OneDnnBf16Linear, OneDnnFp32Linear, TorchLinear
from .metadata import ProbeRecord
from .native import NativeKernels, NativeLayerOps

ROLES = ("attention", "linear", "layer_ops", "greedy", "model")


@dataclass
class BuildContext:
    """What candidate factories may read: the model, the engine's switches, the probe,
    and the backends chosen for the roles before theirs."""

    model: nn.Module
    probe: ProbeRecord
    kernels: NativeKernels
    prepack_linear: bool | None = None
    chosen: dict[str, Backend | None] = field(default_factory=dict)

    @property
    def linear(self) -> LinearBackend | None:
        return self.chosen.get("linear")  # type: ignore[return-value]

    @property
    def layer_ops(self) -> LayerOps | None:
        return self.chosen.get("layer_ops")  # type: ignore[return-value]


Factory = Callable[[BuildContext], Backend]

_CANDIDATES: dict[str, list[Factory]] = {
    "attention": [
        lambda ctx: NativeCpuAttention(ctx.kernels),
        lambda ctx: TorchReferenceAttention(),
    ],
    "linear": [
        lambda ctx: OneDnnFp32Linear(ctx.prepack_linear),
        lambda ctx: OneDnnBf16Linear(ctx.prepack_linear),
        lambda ctx: TorchLinear(),
    ],
    "layer_ops": [lambda ctx: NativeLayerOps(ctx.kernels)],
    "greedy": [lambda ctx: NativeArgmax(ctx.kernels), lambda ctx: TorchArgmax()],
    "model": [
        lambda ctx: FastDecoder(ctx.probe, ctx.linear, ctx.layer_ops),
        lambda ctx: HFModules(ctx.model),
    ],
}


def candidates(role: str) -> tuple[Factory, ...]:
    return tuple(_CANDIDATES[role])


def register(role: str, factory: Factory, *, first: bool = True) -> None:
    """Add a candidate for ``role``: before the others (``first``) or after them."""
    if role not in _CANDIDATES:
        raise ValueError(f"unknown backend role {role!r}; roles are {ROLES}")
    if first:
        _CANDIDATES[role].insert(0, factory)
    else:
        _CANDIDATES[role].append(factory)


def unregister(role: str, factory: Factory) -> None:
    _CANDIDATES[role].remove(factory)


@dataclass(frozen=True)
class Selection:
    """The backend chosen for a role (None: nothing serves it) and why the candidates
    before it refused, as ``(name, reason)``."""

    role: str
    backend: Backend | None
    refusals: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        chosen = self.backend.name if self.backend is not None else "none"
        refused = "; ".join(f"{name}: {reason}" for name, reason in self.refusals)
        return f"{self.role}={chosen}" + (f" (refused {refused})" if refused else "")


def select(role: str, ctx: BuildContext, dtype: torch.dtype, device: torch.device) -> Selection:
    """Ask ``role``'s candidates in order; the first whose ``supports`` answers None serves."""
    refusals: list[tuple[str, str]] = []
    for factory in _CANDIDATES[role]:
        backend = factory(ctx)
        reason = backend.supports(ctx.model, dtype, device)
        if reason is None:
            return Selection(role, backend, tuple(refusals))
        refusals.append((backend.name, reason))
    return Selection(role, None, tuple(refusals))
