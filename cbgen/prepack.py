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
file (safetensors), they are unmapped (``page_out``), so packing costs little
more than the weights once.

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

from .sysmem import file_mappings, unmodified_file_pages

logger = logging.getLogger(__name__)

DISABLE_ENV = "CBGEN_NO_PREPACK"
# Keep q/k/v and gate/up as separate GEMMs (for a model whose code cannot take the
# column views that fused siblings return).
NO_FUSE_ENV = "CBGEN_NO_FUSE"


def prepack_supported() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops (CPU builds with mkldnn)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """``weight`` (``[out, in]``, float32, CPU) reordered into oneDNN's blocked layout."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _packable(x, weight):
            return F.linear(x, weight, bias)
        return packed_linear(x, packed, bias)

    return forward


# Sibling linear maps that every supported architecture calls on one input tensor.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SharedInput:
    """One GEMM for sibling linear maps that read the same input (q/k/v, gate/up).

    Whichever sibling is called first with a new input runs the GEMM of the
    concatenated weights and keeps the result until every sibling has taken its
    columns, so the call order does not matter. Small output widths (192 for
    SmolLM2's k and v) keep oneDNN far from its peak; one 960-wide GEMM for q/k/v and
    one 3072-wide for gate/up took a layer's share from 1.92 to 1.73 ms at 64 rows,
    with bitwise identical outputs (the sums along the input dimension are unchanged).
    """

    def __init__(self, modules: list[nn.Linear], batch_size_hint: int) -> None:
        self.members = tuple(modules)  # in column order
        self.packed = pack_weight(torch.cat([m.weight.detach() for m in modules]), batch_size_hint)
        biases = [m.bias for m in modules]
        self.bias = (
            torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
        )
        bounds = [0]
        for m in modules:
            bounds.append(bounds[-1] + m.out_features)
        self.columns = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def forward_for(self, index: int, module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = module.weight
        bias = module.bias.detach() if module.bias is not None else None
        count = len(self.columns)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not _packable(x, weight):
                return F.linear(x, weight, bias)
            if self._input is not x or index not in self._waiting:
                self._output = packed_linear(x, self.packed, self.bias)
                self._input = x
                self._waiting = set(range(count))
            self._waiting.discard(index)
            out = self._output[..., self.columns[index]]
            if not self._waiting:  # every sibling served: let go of the tensors
                self._input = self._output = None
            return out

        return forward


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # The packed op wants a float32, CPU, non-empty input without autograd;
    # anything else (an empty batch, a training call) takes the plain path.
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


class PackedLinears:
    """The ``nn.Linear`` modules of a model switched to oneDNN prepacked weights.

    Only float32 CPU modules are packed; others are left alone. Siblings named in
    ``FUSED_SIBLINGS`` with the same input width share one packed GEMM
    (``_SharedInput``) unless ``fuse=False`` (default: on unless ``CBGEN_NO_FUSE=1``).
    ``restore()`` (idempotent) gives every module its own ``forward`` back.
    """

    def __init__(
        self, model: nn.Module, batch_size_hint: int = 64, fuse: bool | None = None
    ) -> None:
        if fuse is None:
            fuse = os.environ.get(NO_FUSE_ENV) != "1"
        # What serves each module: its own packed weight and bias, or a fused group.
        self._single: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._fused: dict[nn.Linear, _SharedInput] = {}
        self.released_bytes = 0  # resident bytes of original weights handed back to the OS
        self.fused_groups = 0
        if not prepack_supported():
            return
        file_maps = file_backed_ranges()
        forwards: dict[nn.Linear, Callable[[torch.Tensor], torch.Tensor]] = {}
        for parent in model.modules() if fuse else ():
            for names in FUSED_SIBLINGS:
                siblings = [getattr(parent, name, None) for name in names]
                if all(self._packable_module(m) for m in siblings) and (
                    len({m.in_features for m in siblings}) == 1
                    and len({m.bias is None for m in siblings}) == 1
                    and len({id(m) for m in siblings}) == len(siblings)
                ):
                    group = _SharedInput(siblings, batch_size_hint)
                    for index, module in enumerate(siblings):
                        forwards[module] = group.forward_for(index, module)
                        self._fused[module] = group
                        # Released as soon as packed: the peak holds one copy, not two.
                        self.released_bytes += page_out(module.weight, file_maps)
                    self.fused_groups += 1
        for module in model.modules():
            if not self._packable_module(module) or module in forwards:
                continue
            packed = pack_weight(module.weight, batch_size_hint)
            bias = module.bias.detach() if module.bias is not None else None
            forwards[module] = _packed_forward(module.weight, packed, bias)
            self._single[module] = (packed, bias)
            self.released_bytes += page_out(module.weight, file_maps)
        for module, forward in forwards.items():
            module.forward = forward  # type: ignore[method-assign]

    @staticmethod
    def _packable_module(module: object) -> bool:
        return (
            isinstance(module, nn.Linear)
            and "forward" not in module.__dict__  # already overridden: leave it
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        )

    def __len__(self) -> int:
        return len(self._single) + len(self._fused)

    def packed_weight(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed weight and bias serving ``module`` alone (None: fused, or not packed)."""
        return self._single.get(module)  # type: ignore[call-overload]

    def fused_weight(
        self, modules: tuple[nn.Module, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed weight and bias of one fused group holding exactly ``modules`` in
        this order (their outputs side by side), or None."""
        group = self._fused.get(modules[0])  # type: ignore[call-overload]
        if group is None or len(group.members) != len(modules):
            return None
        if any(a is not b for a, b in zip(group.members, modules, strict=True)):
            return None
        return group.packed, group.bias

    def restore(self) -> None:
        for module in [*self._single, *self._fused]:
            module.__dict__.pop("forward", None)
        self._single.clear()
        self._fused.clear()


_MADV_DONTNEED = 4


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
    return [(mapping.start, mapping.end) for mapping in file_mappings()]


def page_out(tensor: torch.Tensor, file_maps: list[tuple[int, int]]) -> int:
    """Drop the resident pages under ``tensor`` from this process if they are unmodified
    pages of a memory-mapped file; return the bytes released.

    The original weights stay the model's parameters, but once a packed copy serves
    every call little reads them. Loaded from safetensors they are file pages mapped
    privately: ``MADV_DONTNEED`` unmaps them (about 540 MB off the resident set of the
    bundled model) while the OS keeps the file in its page cache, so a later read (the
    embedding lookups of a tied LM head, the plain-path fallback) is a cheap minor fault
    that maps the same bytes again. A page the process has written to is a private copy
    that dropping would revert to the file's contents, so any range holding one, and any
    weight in anonymous memory, is left alone.
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
    if end <= start or not unmodified_file_pages(start, end, page):
        return 0
    if madvise(start, end - start, _MADV_DONTNEED) != 0:
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
