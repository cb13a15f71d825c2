"""The native CPU kernels (``cbgen.executor.cpu.kernels``) as one lazily loaded dependency of the
backends that use them, and the fused layer ops backend.

Loading compiles the kernels on first use; it happens only once a backend has
passed the checks that need no kernel (switched on, CPU device), so asking a
native backend about a CUDA model never starts a compiler.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from .base import LayerOps
from .cpu.kernels import DISABLE_ENV as KERNELS_DISABLE_ENV
from .cpu.kernels import decode_kernel

_UNLOADED = object()


class NativeKernels:
    """The compiled kernel module, loaded on first need, and why it cannot serve."""

    def __init__(
        self, enabled: bool = True, load: Callable[[], ModuleType | None] = decode_kernel
    ) -> None:
        self.enabled = enabled
        self._load = load
        self._module: object = _UNLOADED

    @property
    def loaded(self) -> ModuleType | None:
        """The module if it has been loaded (without loading it)."""
        return None if self._module is _UNLOADED else self._module  # type: ignore[return-value]

    def module(self) -> ModuleType | None:
        if self._module is _UNLOADED:
            self._module = self._load() if self.enabled else None
        return self._module  # type: ignore[return-value]

    def refusal(self, device: torch.device, needs: str | None = None) -> str | None:
        """Why the kernels cannot serve on ``device`` (``needs``: a function they must
        have), or None."""
        if not self.enabled:
            return "native kernels are turned off (EngineConfig.use_native_kernels=False)"
        if device.type != "cpu":
            return f"the native kernels are CPU code and the model is on {device.type}"
        module = self.module()
        if module is None:
            if os.environ.get(KERNELS_DISABLE_ENV) == "1":
                return f"native kernels are turned off ({KERNELS_DISABLE_ENV}=1)"
            return "the native kernels could not be built (see the warning logged then)"
        if needs is not None and not hasattr(module, needs):
            return f"the built kernels have no {needs}"
        return None


class NativeLayerOps(LayerOps):
    """``add_rms_norm``, ``rope_qkv`` and ``silu_mul`` from ``cbgen/executor/cpu/kernels/layer_ops.cpp``: float32 on
    CPU, following transformers' Llama formulas operation by operation (bfloat16 GEMM
    inputs and outputs and caches, with float32 arithmetic)."""

    name = "native-layer-ops"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        reason = self.kernels.refusal(device, "rope_qkv")
        if reason is not None:
            return reason
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the fused layer ops take float32 or bfloat16 and the model is {dtype}"
        module = self.kernels.module()
        assert module is not None
        self.add_rms_norm = module.add_rms_norm
        self.rope_qkv = module.rope_qkv
        self.silu_mul = getattr(module, "silu_mul", None)
        # The layer loop in one call (``cbgen.executor.cpu.layer_stack``), where built.
        self.LayerStack = getattr(module, "LayerStack", None)
        return None
