"""``ModelRunner``: the executor (``cbgen.executor.runner.Executor``) under its old name and
constructor, kept for code that builds one directly."""

from __future__ import annotations

from types import ModuleType

import torch

from .executor.base import model_device
from .executor.runner import Executor

__all__ = ["Executor", "ModelRunner", "model_device"]


class ModelRunner(Executor):
    """An ``Executor`` whose native kernels are the module given as ``kernels`` (None: no
    native kernels, as before the executor chose them itself)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        prepack_linear: bool | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        super().__init__(
            model,
            use_native_kernels=kernels is not None,
            prepack_linear=prepack_linear,
            kernels=lambda: kernels,
        )
