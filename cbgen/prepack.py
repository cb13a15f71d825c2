"""Prepacked float32 linear maps on CPU (oneDNN), applied to a model for an engine's lifetime.

On CPU ``F.linear`` hands every call to a GEMM that re-reads the weight in its
row-major layout; oneDNN can reorder a weight once into the blocked layout its
kernels read fastest. For the bundled SmolLM2 at 64 decode rows and one thread
this took the decoder layers' linear maps from about 262 to 219 ms a step and
the LM head (49152 x 576) from about 106 to 48 ms, and a whole decode step from
about 440 to 320 ms (``bench/micro_step.py --compare no-prepack,prepack``).

The transform overrides ``forward`` on each ``nn.Linear`` instance (so module
identity, hooks on parents and ``state_dict`` are untouched) and keeps the
packed copy beside the original weight, which stays in place: ``restore()``
just drops the overrides. The packed copy costs about 570 MB for SmolLM2 in
float32 (LM head included); where the originals are pages of a memory-mapped
file (safetensors), their resident pages are handed back to the OS
(``page_out``), so packing costs little more than the weights once.

Outputs differ from ``F.linear`` by float32 rounding (the sums run in another
order), which is the same kind of difference batching already makes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DISABLE_ENV = "CBGEN_NO_PREPACK"


def prepack_supported() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops (CPU builds with mkldnn)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_forward(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        # The packed op wants a float32, CPU, non-empty input without autograd;
        # anything else (an empty batch, a training call) takes the plain path.
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return F.linear(x, weight, bias)
        return linear_pointwise(x, packed, bias, "none", [], "")

    return forward


class PackedLinears:
    """The ``nn.Linear`` modules of a model switched to oneDNN prepacked weights.

    Only float32 CPU modules are packed; others are left alone. ``restore()``
    (idempotent) gives every module its own ``forward`` back.
    """

    def __init__(self, model: nn.Module, batch_size_hint: int = 64) -> None:
        self._modules: list[nn.Linear] = []
        self.released_bytes = 0  # resident bytes of original weights handed back to the OS
        if not prepack_supported():
            return
        file_maps = file_backed_ranges()
        # A weight another module reads (a tied embedding) must stay resident.
        shared = {
            m.weight.data_ptr()
            for m in model.modules()
            if not isinstance(m, nn.Linear) and isinstance(getattr(m, "weight", None), torch.Tensor)
        }
        for module in model.modules():
            if not isinstance(module, nn.Linear) or "forward" in module.__dict__:
                continue  # already overridden (by us or someone else): leave it
            weight = module.weight
            if weight.dtype != torch.float32 or weight.device.type != "cpu":
                continue
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
            bias = module.bias.detach() if module.bias is not None else None
            module.forward = _packed_forward(weight, packed, bias)  # type: ignore[method-assign]
            self._modules.append(module)
            if weight.data_ptr() not in shared:
                self.released_bytes += page_out(weight, file_maps)

    def __len__(self) -> int:
        return len(self._modules)

    def restore(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules = []


_MADV_PAGEOUT = 21  # Linux 5.4+


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def file_backed_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's memory-mapped files (Linux; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def page_out(tensor: torch.Tensor, file_maps: list[tuple[int, int]]) -> int:
    """Let the OS reclaim the resident pages under ``tensor`` if a file backs them;
    return the bytes advised.

    The original weights stay the model's parameters, but once a packed copy serves
    every call nothing reads them. Loaded from safetensors they are memory-mapped
    file pages: reclaiming them takes about 430 MB off the resident set of the bundled
    model. A later read (the plain-path fallback) faults the pages back in, from disk
    if the page cache let them go, so ``PackedLinears`` keeps weights that another
    module reads every step (a tied embedding) resident. Weights in anonymous memory
    are left alone: reclaiming those would mean swapping them out.
    """
    madvise = _madvise()
    if (
        madvise is None
        or tensor.device.type != "cpu"
        or tensor.numel() == 0
        or not tensor.is_contiguous()
    ):
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in file_maps):
        return 0
    start = -(-start // page) * page
    end = end // page * page
    if end <= start or madvise(start, end - start, _MADV_PAGEOUT) != 0:
        return 0
    return end - start


def prepack_enabled_by_default(model: nn.Module) -> bool:
    """On for float32 models on CPU, unless ``CBGEN_NO_PREPACK=1``."""
    if os.environ.get(DISABLE_ENV) == "1" or not prepack_supported():
        return False
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return param.device.type == "cpu" and param.dtype == torch.float32
