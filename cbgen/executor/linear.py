"""Linear backends: oneDNN prepacked float32 or bfloat16 on CPU (``cbgen.executor.cpu.prepack``), with the
int8 and 4-bit maps of a quantized model (``cbgen.executor.cpu.quantization``) fused alongside; or the
model's own ``nn.Linear`` (``F.linear``) everywhere else."""

from __future__ import annotations

import os

import torch
from torch import nn

from .base import LinearBackend
from .cpu.prepack import DISABLE_ENV, PackedLinears, prepack_supported


class OneDnnPackedLinear(LinearBackend):
    """Every CPU ``nn.Linear`` of the model's dtype switched to a oneDNN prepacked weight,
    q/k/v and gate/up fused into one GEMM each (``PackedLinears``), for the executor's
    lifetime. Quantized modules (``cbgen.executor.cpu.quantization``) get their own kernels, fused the
    same way. Subclasses name the dtype they pack.

    ``enabled``: ``EngineConfig.prepack_linear``; ``None`` means on unless
    ``CBGEN_NO_PREPACK=1``, ``True`` packs whatever the environment says. Models of
    ``dtype`` on CPU only: a model of another dtype is refused.
    """

    name = "onednn-prepacked"
    dtype: torch.dtype

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
        if dtype != self.dtype:
            return f"it packs {str(self.dtype).removeprefix('torch.')} weights and the model is {dtype}"
        if not prepack_supported():
            return "this torch build has no oneDNN packed-linear ops"
        return None

    def apply(self, model: nn.Module) -> None:
        self.packed = PackedLinears(model, dtype=self.dtype)

    @property
    def modules_served(self) -> int:
        return len(self.packed) if self.packed is not None else 0

    def close(self) -> None:
        if self.packed is not None:
            self.packed.restore()
            self.packed = None


class OneDnnFp32Linear(OneDnnPackedLinear):
    """Float32 weights."""

    name = "onednn-fp32-prepacked"
    dtype = torch.float32


class OneDnnBf16Linear(OneDnnPackedLinear):
    """bfloat16 weights: oneDNN's AVX512_BF16 GEMMs with float32 accumulation (on CPUs
    without AVX512-BF16 oneDNN still runs them, more slowly). On CPUs where oneDNN cannot
    pack bfloat16 at all (no AVX512-BW/VL/DQ or AVX-NE-CONVERT: AVX2-only ones) the maps
    keep plain weights: cbgen's AVX2 row kernel for a few rows, float32 GEMMs on widened
    chunks of them for more (``widened_linear``), with the same fusion."""

    name = "onednn-bf16-prepacked"
    dtype = torch.bfloat16


class TorchLinear(LinearBackend):
    """The model's own ``nn.Linear`` modules, untouched: ``F.linear`` on any device and dtype."""

    name = "torch-linear"

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return None
