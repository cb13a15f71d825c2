"""Prepacked linear maps on CPU (oneDNN, float32 or bfloat16), applied to a model for an
engine's lifetime.

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

bfloat16 weights pack the same way (oneDNN's AVX512_BF16 kernels, float32
accumulation): all of SmolLM2's layer maps at 64 rows took 67 ms against 80 ms
with ``F.linear``, and at one row 6.5 against 11.4 ms (``bench/linear_kernels.py``).
Weight-only int8 and 4-bit maps (``cbgen.executor.cpu.quantization``) are fused here the same way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...sysmem import file_mappings, meminfo_kib, unmodified_file_pages
from .bf16_gemm_choice import fma_gemm_kernel
from .routed_experts import experts_parameters, per_expert, route_tokens, routed_form

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


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack ``dtype`` weights on this CPU. bfloat16 needs AVX512-BW/VL/
    DQ or AVX-NE-CONVERT (``_is_mkldnn_bf16_supported``): on an AVX2-only CPU (AMD Zen 2
    and 3, Intel client cores) the reorder raises, so ``PackedMap`` keeps such weights
    plain there."""
    if dtype is not torch.bfloat16:
        return True
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """``weight`` (``[out, in]``, float32 or bfloat16, CPU) reordered into oneDNN's blocked
    layout."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearMap:
    """``x -> x @ W.T + b`` by some kernel: what the fast decoder calls for each linear map
    (``PackedMap`` here; ``cbgen.executor.cpu.quantization``'s int8 and 4-bit maps)."""

    out_features: int
    # LoRA adapters added to the output (``cbgen.executor.lora.MapLora``), if any serve it.
    lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can take this kernel (else the module's own forward runs)."""
        raise NotImplementedError


class PackedMap(LinearMap):
    """A oneDNN prepacked weight (float32 or bfloat16) and its bias.

    ``row_copy`` (bfloat16 only) also keeps the plain ``[out, in]`` weight for cbgen's
    few-row kernel (``bf16_rows_matmul``), which serves 1 to ``ROW_KERNEL_ROWS`` rows:
    there oneDNN read SmolLM2's weights at ~20 GB/s and the 1B shape's at ~25, the
    row kernel at ~31 (``bench/linear_kernels.py --kinds bf16-packed,bf16-rows``).
    More rows go to oneDNN, whose blocked GEMMs win at batch sizes.

    Where oneDNN cannot pack the dtype (bfloat16 on an AVX2-only CPU: ``onednn_packs``)
    the map holds the plain weight alone (``packed`` is None): the row kernel's AVX2
    build for 1 to ``PLAIN_ROW_KERNEL_ROWS`` rows, ``bf16_avx2_matmul`` (rows in the
    vector lanes) for more, and ``widened_linear`` where that kernel is not built.
    Where the float32 FMA units outrun ``vdpbf16ps`` (``bf16_gemm_choice``: Intel's
    cores without AMX) the map holds the plain weight alone too, and more rows than
    the row kernel's go to ``bf16_fma_matmul``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        hint: int,
        row_copy: bool = False,
    ) -> None:
        self.dtype = weight.dtype
        self.out_features = int(weight.shape[0])
        bf16 = weight.dtype is torch.bfloat16
        self.fma_kernel = fma_gemm_kernel() if bf16 else None
        packs = onednn_packs(weight.dtype) and self.fma_kernel is None
        self.packed = pack_weight(weight, hint) if packs else None
        self.bias = bias
        plain = self.packed is None
        self.rows_kernel = _bf16_rows_kernel() if (row_copy or plain) and bf16 else None
        self.lanes_kernel = _bf16_lanes_kernel() if plain and bf16 else None
        keep = plain or self.rows_kernel is not None
        self.weight = weight.detach().contiguous() if keep else None
        self.row_kernel_rows = PLAIN_ROW_KERNEL_ROWS if plain else ROW_KERNEL_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Rows of every leading shape count: a model's own forward (the models the fast
        # decoder does not build) passes [batch, tokens, hidden], and its decode step's
        # single row had gone to the lanes kernel (Gemma 3 270M, bf16, one stream on the
        # AVX2 EPYC: 91 of 105 ms a token there).
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.rows_kernel is not None and 0 < rows.shape[0] <= self.row_kernel_rows:
            out = self.rows_kernel.bf16_rows_matmul(rows, self.weight, self.bias)
            out = out if rows is x else out.view(*x.shape[:-1], self.out_features)
        elif self.packed is None:
            if self.fma_kernel is not None:
                out = self.fma_kernel.bf16_fma_matmul(rows, self.weight, self.bias)
                out = out.view(*x.shape[:-1], self.out_features)
            elif self.lanes_kernel is not None:
                out = self.lanes_kernel.bf16_avx2_matmul(rows, self.weight, self.bias)
                out = out.view(*x.shape[:-1], self.out_features)
            else:
                out = widened_linear(x, self.weight, self.bias)
        else:
            out = packed_linear(x, self.packed, self.bias)
        if self.lora is not None:
            self.lora(x, out)
        return out

    def accepts(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype


# bf16 maps without oneDNN packing run cbgen's bf16_avx2_matmul at every batch size.
# Until its 4 x 24 register tiles, widened_linear (MKL's float32 GEMM on widened chunks)
# took 128 rows and more; since them the lanes kernel is the faster one there too, and a
# row's bits no longer depend on the batch at any size. SmolLM2's maps and head, ms, on the
# 2026-12-07 AVX2 EPYC (2 threads), widened against lanes: 128 rows 361 against 277, 256
# rows 601 against 484, 1,024 rows 2,148 against 1,903; the 1B shape's at 256 rows 5,179
# against 4,199, at 1,024 rows 18,705 against 17,480.

# Weight bytes widened to float32 at a time by widened_linear (cache-sized chunks).
WIDEN_CHUNK_BYTES = 8 << 20


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` of bfloat16 ``x`` and ``weight`` computed in float32, a cache-sized
    chunk of weight rows widened at a time, rounded once to ``x``'s dtype (the bias
    added before, as oneDNN does).

    Where oneDNN has no bfloat16 (AVX2-only CPUs) torch's own bfloat16 GEMM is slow:
    SmolLM2's layer maps at 64 rows took 696 ms a step on an AMD EPYC (2 threads)
    against 194 ms widened to float32, at 256 rows 2,762 against 454.
    """
    xf = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(xf.shape[0], weight.shape[0], dtype=torch.float32)
    step = max(16, WIDEN_CHUNK_BYTES // (4 * max(1, weight.shape[1])))
    for start in range(0, weight.shape[0], step):
        end = min(weight.shape[0], start + step)
        torch.mm(xf, weight[start:end].float().t(), out=out[:, start:end])
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# The most rows cbgen's bf16 row kernel serves beside oneDNN's packed bfloat16 (a decode
# step of up to 4 sequences); the kernel itself takes up to 8.
ROW_KERNEL_ROWS = 4
# ... and where oneDNN packs no bfloat16 (AVX2-only CPUs), against bf16_avx2_matmul: 30
# layers of SmolLM2's maps on an AMD EPYC (Zen 3, 2 threads) took 20.2 ms at 5 rows and
# 28.4 at 8 on the row kernel, 52.8-54.2 on bf16_avx2_matmul (whose rows-in-lanes tiles
# do one FMA a broadcast with a single vector of rows).
PLAIN_ROW_KERNEL_ROWS = 8
# "1"/"0": keep (or not) the plain bf16 weights for the row kernel, whatever their size.
ROW_COPY_ENV = "CBGEN_BF16_ROW_COPY"
# By default the copy is kept while the plain weights are at most this share of RAM.
ROW_COPY_MEMORY_SHARE = 1 / 8


def _bf16_rows_kernel() -> Any:
    """cbgen's native module where it has the bf16 row kernel (AVX512-BF16 or AVX2), else
    None."""
    from .kernels import decode_kernel

    kernel = decode_kernel()
    return kernel if kernel is not None and kernel.bf16_rows_available() else None


def _bf16_lanes_kernel() -> Any:
    """cbgen's native module where it has ``bf16_avx2_matmul`` (AVX2 and FMA builds without
    AVX512-BF16), else None."""
    from .kernels import decode_kernel

    kernel = decode_kernel()
    return kernel if kernel is not None and kernel.bf16_avx2_available() else None


def row_copy_wanted(weight_bytes: int) -> bool:
    """Whether bf16 maps keep their plain weights beside oneDNN's packed copy for the row
    kernel: that copy doubles the weights' memory, so by default only while it is at
    most ``ROW_COPY_MEMORY_SHARE`` of the machine's RAM (SmolLM2's 269 MB, a 1B model's
    2.5 GB on 24 GiB; not a 3B model's 6.2 GB). ``CBGEN_BF16_ROW_COPY=1``/``0`` decides."""
    forced = os.environ.get(ROW_COPY_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    total_kib = meminfo_kib("MemTotal")
    return total_kib is not None and weight_bytes <= total_kib * 1024 * ROW_COPY_MEMORY_SHARE


def _plain_call(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    # The packed ops want a CPU, non-empty input without autograd; anything else (an
    # empty batch, a training call) takes the module's own path.
    return (
        x.device.type != "cpu"
        or x.numel() == 0
        or (
            torch.is_grad_enabled()
            and (x.requires_grad or bool(getattr(weight, "requires_grad", False)))
        )
    )


def _mapped_forward(
    module: nn.Module, linear_map: LinearMap
) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = type(module).forward.__get__(module)
    weight = getattr(module, "weight", None)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if _plain_call(x, weight) or not linear_map.accepts(x):
            return plain(x)
        return linear_map(x)

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

    def __init__(self, modules: list[nn.Module], linear_map: LinearMap) -> None:
        self.members = tuple(modules)  # in column order
        self.map = linear_map
        bounds = [0]
        for m in modules:
            bounds.append(bounds[-1] + int(m.out_features))
        self.columns = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def forward_for(self, index: int, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        plain = type(module).forward.__get__(module)
        weight = getattr(module, "weight", None)
        count = len(self.columns)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if _plain_call(x, weight) or not self.map.accepts(x):
                return plain(x)
            if self._input is not x or index not in self._waiting:
                self._output = self.map(x)
                self._input = x
                self._waiting = set(range(count))
            self._waiting.discard(index)
            out = self._output[..., self.columns[index]]
            if not self._waiting:  # every sibling served: let go of the tensors
                self._input = self._output = None
            return out

        return forward


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` that is only its matrix product. A subclass with a forward of its
    own (PhiMoE's router returns a tuple) is more than that, and keeps its own forward
    (no prepacked or quantized copy replaces it)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class PackedLinears:
    """The linear maps of a model switched to prepacked kernels.

    ``nn.Linear`` modules whose weights are ``dtype`` (float32 or bfloat16) on CPU get
    a oneDNN prepacked weight (``PackedMap``); quantized modules
    (``cbgen.executor.cpu.quantization.QuantizedLinear``, anything with a ``fused_map`` classmethod)
    get their own kernel. Others are left alone. Siblings named in ``FUSED_SIBLINGS``
    of one kind with the same input width share one GEMM (``_SharedInput``) unless
    ``fuse=False`` (default: on unless ``CBGEN_NO_FUSE=1``). ``restore()``
    (idempotent) gives every module its own ``forward`` back.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size_hint: int = 64,
        fuse: bool | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if fuse is None:
            fuse = os.environ.get(NO_FUSE_ENV) != "1"
        if dtype not in PACKED_DTYPES:
            raise ValueError(f"oneDNN packs {PACKED_DTYPES} weights, not {dtype}")
        self.dtype = dtype
        self._hint = batch_size_hint
        self.row_copy = dtype is torch.bfloat16 and row_copy_wanted(
            sum(
                m.weight.numel() * m.weight.element_size()
                for m in model.modules()
                if isinstance(m, nn.Linear) and self._servable(m)
            )
        )
        # What serves each module: its own map, or a fused group.
        self._single: dict[nn.Module, LinearMap] = {}
        self._fused: dict[nn.Module, _SharedInput] = {}
        self._experts: list[nn.Module] = []  # MoE experts modules routed through PackedMaps
        self.released_bytes = 0  # resident bytes of original weights handed back to the OS
        self.fused_groups = 0
        if not prepack_supported():
            return
        file_maps = file_backed_ranges()
        forwards: dict[nn.Module, Callable[[torch.Tensor], torch.Tensor]] = {}
        for parent in model.modules() if fuse else ():
            for names in FUSED_SIBLINGS:
                siblings = [getattr(parent, name, None) for name in names]
                if not self._fusable(siblings):
                    continue
                linear_map = self._map_for(siblings)  # type: ignore[arg-type]
                if linear_map is None:
                    continue
                group = _SharedInput(siblings, linear_map)  # type: ignore[arg-type]
                for index, module in enumerate(siblings):
                    assert module is not None
                    forwards[module] = group.forward_for(index, module)
                    self._fused[module] = group
                    # Released as soon as packed: the peak holds one copy, not two.
                    self.released_bytes += self._page_out(module, file_maps)
                self.fused_groups += 1
        for module in model.modules():
            if not self._servable(module) or module in forwards:
                continue
            linear_map = self._map_for([module])
            if linear_map is None:
                continue
            forwards[module] = _mapped_forward(module, linear_map)
            self._single[module] = linear_map
            self.released_bytes += self._page_out(module, file_maps)
        if dtype is torch.bfloat16 and not onednn_packs(dtype):
            for module in model.modules():
                forward = self._experts_forward(module)
                if forward is not None:
                    forwards[module] = forward
                    self._experts.append(module)
        for module, forward in forwards.items():
            module.forward = forward  # type: ignore[method-assign]

    def _experts_forward(
        self, module: nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """An MoE layer's bfloat16 experts through cbgen's bf16 kernels, where oneDNN packs
        no bfloat16 (AVX2-only CPUs): a ``PackedMap`` over each expert's slice of the 3D
        weights (views, no copy), routed as transformers' eager loop routes
        (``routed_experts``). transformers' own path there is torch's bf16 GEMM, which
        is slow on those CPUs (an OLMoE-1B-7B shape in bf16 ran 5.4 tok/s on one
        stream). None for modules that are not such experts."""
        if "forward" in module.__dict__ or experts_parameters(module) is None:
            return None
        own = list(module.parameters(recurse=False))
        if any(p.dtype is not torch.bfloat16 or p.device.type != "cpu" for p in own):
            return None
        try:
            form = routed_form(module)
        except ValueError as error:
            logger.info("cbgen: %s keeps its own forward: %s", type(module).__name__, error)
            return None
        if form.transposed:  # its per-expert [out, in] maps would be copies
            return None

        def maps(weight: torch.Tensor, bias: torch.Tensor | None) -> list[LinearMap]:
            return [
                PackedMap(one, None if bias is None else bias[e], self._hint)
                for e, one in enumerate(form.expert_weights(weight))
            ]

        first, down = (
            maps(form.first_weight, form.first_bias),
            maps(form.down_weight, form.down_bias),
        )

        def forward(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            return route_tokens(
                hidden_states,
                top_k_index,
                top_k_weights,
                per_expert(first),
                per_expert(down),
                form.activate,
                form.num_experts,
            )

        return forward

    def _servable(self, module: object) -> bool:
        if not isinstance(module, nn.Module) or "forward" in module.__dict__:
            return False  # not a module, or already overridden: leave it
        if isinstance(module, nn.Linear):
            return (
                plain_linear(module)
                and module.weight.dtype == self.dtype
                and module.weight.device.type == "cpu"
            )
        return hasattr(type(module), "fused_map") and all(
            t.device.type == "cpu" for t in module.buffers()
        )

    def _fusable(self, siblings: list[object]) -> bool:
        if not all(self._servable(m) for m in siblings):
            return False
        modules: list[Any] = siblings
        return (
            len({type(m) for m in modules}) == 1
            and len({m.in_features for m in modules}) == 1
            and len({m.bias is None for m in modules}) == 1
            and len({id(m) for m in modules}) == len(modules)
        )

    def _map_for(self, modules: list[nn.Module]) -> LinearMap | None:
        first: Any = modules[0]
        if not isinstance(first, nn.Linear):
            return type(first).fused_map(modules)  # type: ignore[no-any-return]
        weight = torch.cat([m.weight.detach() for m in modules])  # type: ignore[misc]
        biases = [m.bias for m in modules]
        bias = (
            torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
        )  # type: ignore[union-attr]
        return PackedMap(weight, bias, self._hint, row_copy=self.row_copy)

    @staticmethod
    def _page_out(module: nn.Module, file_maps: list[tuple[int, int]]) -> int:
        weight = getattr(module, "weight", None)
        return page_out(weight, file_maps) if isinstance(weight, torch.Tensor) else 0

    def __len__(self) -> int:
        return len(self._single) + len(self._fused)

    def packed_weight(self, module: nn.Module | None) -> LinearMap | None:
        """The map serving ``module`` alone (None: fused, or not packed)."""
        return self._single.get(module) if module is not None else None

    def fused_weight(self, modules: tuple[nn.Module, ...]) -> LinearMap | None:
        """The map of one fused group holding exactly ``modules`` in this order (their
        outputs side by side), or None."""
        group = self._fused.get(modules[0])
        if group is None or len(group.members) != len(modules):
            return None
        if any(a is not b for a, b in zip(group.members, modules, strict=True)):
            return None
        return group.map

    def serving(self, module: nn.Module) -> tuple[LinearMap, slice] | None:
        """The map serving ``module`` and the columns of its output that are the module's
        (all of them unless it is fused with siblings), or None if none does."""
        single = self._single.get(module)
        if single is not None:
            return single, slice(None)
        group = self._fused.get(module)
        if group is None:
            return None
        return group.map, group.columns[group.members.index(module)]

    def restore(self) -> None:
        for module in [*self._single, *self._fused, *self._experts]:
            module.__dict__.pop("forward", None)
        self._single.clear()
        self._fused.clear()
        self._experts.clear()


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


def row_slices(tensor: torch.Tensor, max_elements: int) -> list[slice]:
    """Slices of ``tensor``'s first dimension holding at most ``max_elements`` each (at
    least one row): for work on a large weight a bounded piece at a time."""
    step = max(1, max_elements // max(1, tensor[0].numel())) if tensor.shape[0] else 1
    return [slice(start, start + step) for start in range(0, tensor.shape[0], step)]


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
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in file_maps):
        return 0
    return _page_out_range(start, end)


def page_out_files(suffix: str) -> int:
    """``page_out`` for every memory-mapped file of this process named ``*suffix``, whole:
    for reads made through copies, whose source tensors are out of reach (the
    per-expert weights transformers stacks into one tensor a layer while loading)."""
    return sum(
        _page_out_range(mapping.start, mapping.end)
        for mapping in file_mappings()
        if mapping.path.endswith(suffix)
    )


def _page_out_range(start: int, end: int) -> int:
    madvise = _madvise()
    if madvise is None:
        return 0
    page = mmap.PAGESIZE
    start = -(-start // page) * page
    end = end // page * page
    if end <= start or not unmodified_file_pages(start, end, page):
        return 0
    if madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


def prepack_enabled_by_default(model: nn.Module) -> bool:
    """On for float32 and bfloat16 models on CPU, unless ``CBGEN_NO_PREPACK=1``."""
    if os.environ.get(DISABLE_ENV) == "1" or not prepack_supported():
        return False
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return param.device.type == "cpu" and param.dtype in PACKED_DTYPES
