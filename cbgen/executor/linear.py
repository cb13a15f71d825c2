"""Linear backends: oneDNN prepacked float32 on CPU (``cbgen.prepack``), or the model's own
``nn.Linear`` (``F.linear``) everywhere else. bfloat16 and int8 backends go here."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..prepack import DISABLE_ENV, PackedLinears, prepack_supported
from .base import LinearBackend


class OneDnnFp32Linear(LinearBackend):
    """Every float32 CPU ``nn.Linear`` switched to a oneDNN prepacked weight, q/k/v and
    gate/up fused into one GEMM each (``PackedLinears``), for the executor's lifetime.

    ``enabled``: ``EngineConfig.prepack_linear``; ``None`` means on unless
    ``CBGEN_NO_PREPACK=1``, ``True`` packs whatever the environment says. Float32
    models on CPU only: a model of another dtype is refused (``prepack_linear=True``
    used to pack its float32 modules, if it had any, and none of the others).
    """

    name = "onednn-fp32-prepacked"

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self.packed: PackedLinears | None = None

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        if self.enabled is False:
            return "turned off (EngineConfig.prepack_linear=False)"
        if self.enabled is None and os.environ.get(DISABLE_ENV) == "1":
            return f"turned off ({DISABLE_ENV}=1)"
        if device.type != "cpu":
            return f"oneDNN prepacking runs on CPU and the model is on {device.type}"
        if dtype != torch.float32:
            return f"it packs float32 weights and the model is {dtype}"
        if not prepack_supported():
            return "this torch build has no oneDNN packed-linear ops"
        return None

    def apply(self, model: nn.Module) -> None:
        self.packed = PackedLinears(model)

    @property
    def modules_served(self) -> int:
        return len(self.packed) if self.packed is not None else 0

    def close(self) -> None:
        if self.packed is not None:
            self.packed.restore()
            self.packed = None


class TorchLinear(LinearBackend):
    """The model's own ``nn.Linear`` modules, untouched: ``F.linear`` on any device and dtype."""

    name = "torch-linear"

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return None
