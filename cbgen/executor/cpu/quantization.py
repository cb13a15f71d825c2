"""int8 and 4-bit linear maps on CPU: torch's quantized-matmul kernels, and cbgen's own
where torch's read the weights too slowly.

A single request reads every weight once per token, so its speed is bytes of weights
over memory bandwidth: 540 MB a token for SmolLM2 in float32, 270 MB in bfloat16,
135 MB in int8 and about 75 MB in 4-bit. This module's ``QuantizedLinear`` holds int8
or packed 4-bit codes and their scales; ``model_quantization.quantize_model`` swaps a
model's ``nn.Linear`` modules (and its MoE experts) for them:

* ``"int8"``: symmetric, one scale per output channel;
  ``torch._weight_int8pack_mm`` (bfloat16 activations, int8 weights widened in
  registers), and cbgen's ``int8_rows_matmul`` where the kernels have AVX512-VNNI.
* ``"int4"``: asymmetric, a scale and a minimum per group of ``group_size`` (32)
  input columns: the layout of GGUF's Q4_1 blocks, so quantizing the bundled model's
  dequantized Q4_1 weights finds the file's own grid back (up to the bfloat16 rounding
  of the scales); ``group_size`` 64, 128 or 256 reads fewer bytes. bfloat16
  activations; cbgen's ``int4_bf16_matmul`` (AVX512-BF16 and VBMI2), its
  ``int4_avx2_matmul`` on AVX2-only CPUs, else ``torch._weight_int4pack_mm_for_cpu``.
* ``"w4a8"``: ``"int4"``'s codes, with each row's activations quantized to int8 per
  group of 32 (dynamic, one scale a group) and multiplied by ``vpdpbusd``
  (AVX512-VNNI) in ``kernels/int4_matmul.cpp``: llama.cpp's Q4 arithmetic, for a
  small quality cost (the quality table in ``docs/precision-and-speed.md``).

Activations enter the kernels in bfloat16 (torch's float32 paths are 30-100x slower)
and leave in the caller's dtype. Measured on the 2-core machine, all of a model's
layer maps with distinct weights: ``bench/linear_kernels.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .prepack import LinearMap, row_slices

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8", "int4", "w4a8")
# The modes whose codes are 4-bit (Q4_1's layout); w4a8 also quantizes activations.
FOUR_BIT_MODES = ("int4", "w4a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPE = torch.bfloat16


def validate_mode(mode: str | None, name: str = "quantization") -> str | None:
    """``mode`` if it is None or one of ``QUANTIZATION_MODES``; else a ValueError naming
    them (and ``name``, the setting)."""
    if mode is not None and mode not in QUANTIZATION_MODES:
        raise ValueError(f"{name} must be one of {QUANTIZATION_MODES} or None, got {mode!r}")
    return mode


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(codes int8 [out, in], scales float32 [out])``
    with ``weight ~= codes * scales[:, None]``. A weight that is not finite is refused
    (ValueError): it has no code."""
    native = _native_quantizer(weight)
    if native is not None:
        codes, scales = native.quantize_8bit(weight.detach())
        return codes, scales
    out_features = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(weight):
        # In place on one float32 copy of the chunk: half the passes over memory of
        # fresh temporaries for each step, the same operations and results.
        w = _finite_copy(weight, rows)
        scale = w.abs().amax(dim=1).div_(127.0).clamp_(min=1e-10)
        codes[rows] = w.div_(scale[:, None]).round_().clamp_(-127, 127)
        scales[rows] = scale
    return codes, scales


def _native_quantizer(weight: torch.Tensor) -> Any:
    """The compiled kernels when they can quantize ``weight`` (on the CPU, in float32,
    bfloat16 or float16): ``kernels/quantize.cpp``, torch's formulas below in one pass
    a row, the same bits (a 1B model's maps in about a tenth of the time). None where
    the kernels are off: the torch path stands in."""
    if weight.device.type != "cpu" or weight.dtype not in _NATIVE_QUANTIZE_DTYPES:
        return None
    return _native_kernel()


_NATIVE_QUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _finite_copy(weight: torch.Tensor, rows: slice) -> torch.Tensor:
    """A float32 copy of ``weight[rows]``, refused if any value is not finite (NaN or
    infinity has no code; the native quantizers refuse it too)."""
    w = weight[rows].detach().to(torch.float32, copy=True)
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).any(dim=1).nonzero()[0, 0]) + (rows.start or 0)
        raise ValueError(
            f"row {bad} of the weight holds a value that is not finite (NaN or infinity)"
        )
    return w


# Weight elements quantized at a time, in whole output rows: every formula is per row
# (or per group within a row), so chunks change no result, and they bound the float32
# temporaries. Whole, a tied 128,256 x 2,048 LM head made 2-3 GB of them, the peak of
# loading a 1B model.
QUANTIZE_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(weight: torch.Tensor) -> list[slice]:
    return row_slices(weight, QUANTIZE_CHUNK_ELEMENTS)


def quantize_int4(
    weight: torch.Tensor, group_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group_size`` input columns: ``(codes uint8 [out, in]
    in 0..15, scales [out, groups], minima [out, groups])`` with
    ``weight ~= codes * scale + minimum`` (GGUF's Q4_1 formula). A weight that is not
    finite is refused (ValueError)."""
    packed, scales, low = quantize_int4_packed(weight, group_size)
    return _unpack_nibbles(packed), scales, low


def quantize_int4_packed(
    weight: torch.Tensor, group_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_int4`` with the codes two to a byte (``[out, in / 2]``: column ``2j`` in
    the low nibble of byte ``j``), as ``QuantizedLinear`` keeps them."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} input columns are not a multiple of {group_size}")
    native = _native_quantizer(weight)
    if native is not None:
        packed, scales, low = native.quantize_4bit(weight.detach(), group_size)
        return packed, scales, low
    groups = in_features // group_size
    codes = torch.empty(out_features, groups, group_size, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out_features, groups, dtype=torch.float32, device=weight.device)
    low = torch.empty(out_features, groups, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(weight):
        # As in quantize_int8: in place on one float32 copy, the same operations and codes.
        w = _finite_copy(weight, rows).view(-1, groups, group_size)
        lowest, highest = torch.aminmax(w, dim=-1)
        scale = highest.sub_(lowest).div_(15.0).clamp_(min=1e-10)
        codes[rows] = w.sub_(lowest[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)
        low[rows] = lowest
        scales[rows] = scale
    return _pack_nibbles(codes.view(out_features, in_features)), scales, low


def dequantize(module: QuantizedLinear) -> torch.Tensor:
    """The float32 weight ``module`` stands for (the reference its kernels are tested on)."""
    if module.mode == "int8":
        return module.codes.float() * module.scales[:, None]
    codes, scales, minima = module.unpacked()
    groups = module.in_features // module.group_size
    weight = codes.float().view(module.out_features, groups, -1)
    weight = weight * scales[..., None] + minima[..., None]
    return weight.view(module.out_features, module.in_features)


def _scales_minima(scales: torch.Tensor, minima: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, groups]`` scales and minima as the kernels keep them: bfloat16
    ``[out / 16, groups, 32]``, each block of 16 rows' scales then its minima."""
    blocks, groups = scales.shape[0] // 16, scales.shape[1]

    def reblock(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).reshape(blocks, 16, groups).transpose(1, 2)

    return torch.cat([reblock(scales), reblock(minima)], dim=2).contiguous()


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.empty(
        packed.shape[0], 2 * packed.shape[1], dtype=torch.uint8, device=packed.device
    )
    torch.bitwise_and(packed, 0x0F, out=codes[:, 0::2])
    torch.bitwise_right_shift(packed, 4, out=codes[:, 1::2])
    return codes


# How a 4-bit module's codes lie, by the kernel that reads them: int4_bf16_pack's
# blocks of 16 rows by pairs of adjacent columns (the "bf16" and "avx2" paths), or
# int4_vnni_pack's by quads (w4a8's "vnni"), or two codes a byte along each row (torch's
# kernel, which repacks them its own way). Units of each group of 32 codes, and the codes
# in a unit: the native layouts are [blocks, groups, units, 16 rows, codes a unit].
LAYOUTS = {"pairs": (8, 2), "quads": (4, 4), "rows": (0, 0)}
_PATH_LAYOUT = {"bf16": "pairs", "avx2": "pairs", "vnni": "quads", "torch": "rows"}


class QuantizedLinear(nn.Module):
    """A linear map with int8 or 4-bit weights (buffers, so ``state_dict`` keeps them).

    Made with ``from_linear``; ``forward`` takes any float input (computed in bfloat16,
    returned in the input's dtype). ``fused_map`` builds one kernel over several
    siblings (q/k/v, gate/up) for ``cbgen.executor.cpu.prepack.PackedLinears``.

    int8: ``codes`` int8 ``[out, in]`` and ``scales`` float32 ``[out]``. 4-bit: ``codes``
    in the layout of the kernel that runs them on this machine (``layout``, see
    ``LAYOUTS``) and ``scales_minima``, bfloat16 ``[out / 16, in / group_size, 32]``
    (each block of 16 rows' scales, then its minima): the kernels read the module's own
    tensors, and a fused group's members hold views of the group's. A 1B model had kept
    its codes and float32 scales twice, the module's and the kernel's (0.7 GB of its
    2.45 GB). ``unpacked()`` gives codes, scales and minima in rows, whatever the
    layout; the state dict is the layout's, so it moves between machines whose kernels
    read the same one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mode: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int = 0,
        layout: str = "rows",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.group_size, self.layout = mode, group_size, layout
        self.register_buffer("codes", codes)
        self.register_buffer("scales" if mode == "int8" else "scales_minima", scales)
        self.register_buffer("bias", bias)
        self._map: LinearMap | None = None

    codes: torch.Tensor
    scales: torch.Tensor  # int8
    scales_minima: torch.Tensor  # 4-bit
    bias: torch.Tensor | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group_size: int = 32) -> QuantizedLinear:
        return cls.from_weight(linear.weight, linear.bias, mode, group_size)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int = 32
    ) -> QuantizedLinear:
        """A module for ``weight`` ``[out, in]`` (and ``bias``), quantized in ``mode``: how
        maps that are not ``nn.Linear`` modules (an MoE layer's experts) get codes."""
        bias = bias.detach().float().clone() if bias is not None else None
        out_features, in_features = weight.shape
        if mode == "int8":
            codes, scales = quantize_int8(weight)
            return cls(in_features, out_features, mode, codes, scales, bias)
        if mode not in FOUR_BIT_MODES:
            raise ValueError(f"unknown quantization mode {mode!r}")
        nibbles, scales, minima = quantize_int4_packed(weight, group_size)
        native = _native_4bit(out_features, in_features, nibbles.device, group_size)
        layout = _PATH_LAYOUT[_four_bit_path(native, mode == "w4a8", group_size)]
        if layout == "rows":
            codes, scales_minima = nibbles, _scales_minima(scales, minima)
        else:
            pack = native.int4_vnni_pack if layout == "quads" else native.int4_bf16_pack
            codes, scales_minima = pack(nibbles, scales, minima, nibbles=True)
        return cls(in_features, out_features, mode, codes, scales_minima, bias, group_size, layout)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A 4-bit module's ``(codes uint8 [out, in] in 0..15, scales, minima float32
        [out, in / group_size])``, ``weight ~= codes * scale + minimum``, from whichever
        layout holds them (the reference the kernels are tested on; not a fast path)."""
        if self.mode not in FOUR_BIT_MODES:
            raise ValueError(f"unpacked() is for 4-bit modules, not {self.mode}")
        n, k = self.out_features, self.in_features
        units, width = LAYOUTS[self.layout]
        if self.layout == "rows":
            codes = _unpack_nibbles(self.codes)
        else:
            blocks, groups = n // 16, k // 32
            unit = self.codes.view(blocks, groups, units, 16, width).permute(0, 3, 1, 2, 4)
            low = (unit & 15).reshape(blocks, 16, groups, 16)
            high = (unit >> 4).reshape(blocks, 16, groups, 16)
            codes = torch.cat([low, high], dim=-1).reshape(n, k)
        both = self.scales_minima.float().transpose(1, 2)  # [blocks, 32, scale groups]
        scales = both[:, :16].reshape(n, -1)
        minima = both[:, 16:].reshape(n, -1)
        return codes, scales, minima

    def extra_repr(self) -> str:
        group = (
            f", group_size={self.group_size}, layout={self.layout}"
            if self.mode in FOUR_BIT_MODES
            else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode}{group}, bias={self.bias is not None}"
        )

    def kernel(self) -> LinearMap:
        """This module's own kernel, built on first use (the executor's probe forward) and
        kept until a fused group takes its place."""
        if self._map is None:
            self._map = self._build([self])
        return self._map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel()(x)

    @classmethod
    def fused_map(cls, modules: list[Any]) -> LinearMap | None:
        """One kernel for ``modules`` side by side (their outputs concatenated), or None if
        they differ in mode, group size or having a bias. A single module's is its own
        kernel; a fused group's replaces the members' own, which are dropped. A native
        4-bit group's codes are the members' stacked, and each member then holds a view
        of its rows there instead of its own copy."""
        if len(modules) == 1:
            return modules[0].kernel()  # type: ignore[no-any-return]
        first = modules[0]
        if any(m.mode != first.mode or m.group_size != first.group_size for m in modules):
            return None
        if len({m.bias is None for m in modules}) != 1:
            return None
        fused = cls._build(modules)
        for module in modules:
            module._map = None
        if isinstance(fused, Int4Map) and fused.path != "torch":
            start = 0
            for module in modules:
                rows = slice(start, start + module.out_features // 16)
                module.codes, module.scales_minima = fused.packed[rows], fused.scales_minima[rows]
                start = rows.stop
        return fused

    @staticmethod
    def _build(modules: list[Any]) -> LinearMap:
        first = modules[0]
        bias = _joined([m.bias for m in modules]) if first.bias is not None else None
        if first.mode == "int8":
            return Int8Map(
                _joined([m.codes for m in modules]), _joined([m.scales for m in modules]), bias
            )
        if first.layout != "rows" and all(m.layout == first.layout for m in modules):
            maps = [Int4Map.of_module(m) for m in modules]
            fused = maps[0] if len(maps) == 1 else Int4Map.side_by_side(maps, bias)
            if fused is not None:
                return fused
        parts = [m.unpacked() for m in modules]
        codes, scales, minima = (_joined([part[i] for part in parts]) for i in range(3))
        return Int4Map(
            codes,
            scales,
            minima,
            first.group_size,
            bias,
            int8_activations=first.mode == "w4a8",
            use_native_kernels=False,
        )


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated; one alone as it is. The 4-bit packers copy what they read,
    and an int8 map's kernel now shares its module's codes instead of holding a second
    copy: copying every single map's codes was a fifth of a 3B model's engine build."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class _QuantizedMap(LinearMap):
    def __init__(self, out_features: int, bias: torch.Tensor | None) -> None:
        self.out_features = out_features
        self.bias = bias.to(COMPUTE_DTYPE) if bias is not None else None

    def accepts(self, x: torch.Tensor) -> bool:
        return x.is_floating_point()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype is COMPUTE_DTYPE
            and x.dim() == 2
            and self.bias is None
            and self.lora is None
            and x.is_contiguous()
        ):
            # The fast decoder's call: nothing to convert, reshape or add (a single
            # stream makes 121 of these a token, and the general path's conversions
            # cost about 3 us each).
            return self._matmul(x)
        rows = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()
        out = self._matmul(rows)
        if self.bias is not None:
            out.add_(self.bias)
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.lora is not None:
            self.lora(x, out)
        return out


class Int8Map(_QuantizedMap):
    """int8 ``[out, in]`` codes, one scale per output: cbgen's ``int8_rows_matmul`` for up
    to ``rows_limit`` rows (every count, where the kernels have AVX512-VNNI), else
    ``torch._weight_int8pack_mm``.

    torch's kernel reads the codes at ~17 GB/s on 2 cores at one row; the native one
    reads the same row-major codes at ~31 (all of a 1B model's int8 maps and head at one
    row: 66 -> 40 ms, ``bench/linear_kernels.py --kinds int8-torch,int8``), and with
    more rows it is 2-2.5x torch's on a 1B model's 128,256 x 2,048 head (the 4-bit modes'
    int8 head: 320 -> 133 ms at 64 rows). It rounds the activations to int16 per group
    of 256 columns (a step of 2^-15 of the group's largest magnitude, far below their own
    bfloat16 rounding) for exact integer sums, so a row's output does not depend on the
    rows beside it.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(int(codes.shape[0]), bias)
        self.codes = codes.contiguous()
        self.scales = scales.to(COMPUTE_DTYPE)
        self.rows_kernel = _native_kernel() if codes.device.type == "cpu" else None
        self.rows_limit = self.rows_kernel.int8_rows_limit() if self.rows_kernel else 0

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.rows_limit and self.rows_kernel is not None:
            return self.rows_kernel.int8_rows_matmul(x, self.codes, self.scales)
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


class Int4Map(_QuantizedMap):
    """4-bit weights, a scale and a minimum per group of ``group_size`` input columns.

    Four kernels, by ``path``:

    * ``"bf16"`` (``int4``, where cbgen's kernels have AVX512-BF16 and VBMI2; groups
      of 32, 64, 128 or 256): ``int4_bf16_matmul`` turns each code into an exact bfloat16
      with one or two vector ops and multiplies it by the bfloat16 activations with
      ``vdpbf16ps``, float32 sums.
      No activation rounding, so int4's quality; it reads weights near bandwidth where
      torch's kernel did not.
    * ``"vnni"`` (``w4a8``, ``int8_activations``, where they have AVX512-VNNI or AVX2):
      ``int4_vnni_matmul`` quantizes each row's activations to int8 per group of 32, as
      llama.cpp's Q4 kernels do, and ``vpdpbusd`` multiplies 64 codes by 64 activations
      in one instruction. Its AVX2 build takes the same layout 32 codes at a time with
      ``vpmaddubsw``, summing a group in int16 (half the multiplies of the ``"avx2"``
      path's int16 activations: 1.5-1.7x its speed with the weights in cache, about
      the same streaming them at one row).
    * ``"avx2"`` (``int4`` on CPUs with AVX2 and FMA but no AVX-512:
      AMD Zen 2 and 3, Intel client cores): ``int4_avx2_matmul`` on ``int4_bf16_pack``'s
      layout rounds each row's activations to int16 per group (2^-15 of its largest
      magnitude, far below bfloat16's own rounding) and ``vpmaddwd`` makes exact int32
      sums of codes times activations.
    * ``"torch"`` (anything else, or ``use_native_kernels=False``):
      ``torch._weight_int4pack_mm_for_cpu`` on codes packed by torch for it, with
      ``[groups, out, 2]`` scales and offsets (torch's formula is ``(q - 8) * scale +
      offset``, so the offset is ``minimum + 8 * scale``). It widens every code to
      float, about ten vector instructions per 16 bytes of codes, so on 2 cores it reads
      weights at ~23 GB/s where llama.cpp's Q4 kernels read ~33. A w4a8 map that lands
      here says so once in the log.

    The native kernels pack the codes each their own way (``int4_bf16_pack``,
    ``int4_vnni_pack``) beside the same bfloat16 scales and minima. The constructor
    packs: ``codes`` uint8 ``[out, in]`` in 0..15, or with ``nibbles`` two a byte
    ``[out, in / 2]``, the quantizer's form (the native packers read those directly:
    widening a 1B model's codes to a byte each first took a second of its load).
    ``of_module`` serves a ``QuantizedLinear``'s tensors as they are: the module packs
    once, when it is made. Figures: ``bench/linear_kernels.py --kinds
    int4-torch,int4,w4a8``.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        minima: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        int8_activations: bool = False,
        use_native_kernels: bool = True,
        nibbles: bool = False,
    ) -> None:
        super().__init__(int(codes.shape[0]), bias)
        self.group_size = group_size
        in_features = int(codes.shape[1]) * (2 if nibbles else 1)
        self.native: Any = (
            _native_4bit(codes.shape[0], in_features, codes.device, group_size)
            if use_native_kernels
            else None
        )
        self.path = _four_bit_path(self.native, int8_activations, group_size)
        if self.native is not None and self.path != "torch":
            pack = self.native.int4_vnni_pack if self.path == "vnni" else self.native.int4_bf16_pack
            self.packed, self.scales_minima = pack(
                codes, scales.float(), minima.float(), nibbles=nibbles
            )
            return
        if nibbles:
            codes = _unpack_nibbles(codes)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        offsets = minima + 8 * scales
        self.scales_and_offsets = (
            torch.stack([scales.t(), offsets.t()], dim=-1).contiguous().to(COMPUTE_DTYPE)
        )

    @classmethod
    def side_by_side(cls, maps: list[Int4Map], bias: torch.Tensor | None) -> Int4Map | None:
        """One map whose outputs are ``maps``' outputs concatenated (its bias ``bias``: theirs
        side by side), from their packed codes as they are, or None unless all run the same
        native kernel on the same groups.

        The native layouts hold whole blocks of 16 output rows, so stacking the blocks
        is packing the concatenated codes: the engine's probe forward builds each map's
        own kernel, and repacking q/k/v and gate/up for their fused maps was a third of
        a 3B model's engine build."""
        first = maps[0]
        if first.path == "torch" or any(
            m.path != first.path or m.group_size != first.group_size for m in maps
        ):
            return None
        return cls._prepacked(
            sum(m.out_features for m in maps),
            bias,
            first.group_size,
            first.native,
            first.path,
            torch.cat([m.packed for m in maps]),
            torch.cat([m.scales_minima for m in maps]),
        )

    @classmethod
    def of_module(cls, module: QuantizedLinear) -> Int4Map:
        """The native kernel over a 4-bit ``module``'s own packed tensors, not a copy
        (``module.layout`` must be a native one)."""
        native = _native_kernel()
        path = _four_bit_path(native, module.mode == "w4a8", module.group_size)
        if _PATH_LAYOUT[path] != module.layout:
            raise ValueError(
                f"codes packed for {module.layout!r}, but this machine's kernel reads "
                f"{_PATH_LAYOUT[path]!r}: quantize the model here"
            )
        return cls._prepacked(
            module.out_features,
            module.bias,
            module.group_size,
            native,
            path,
            module.codes,
            module.scales_minima,
        )

    @classmethod
    def _prepacked(
        cls,
        out_features: int,
        bias: torch.Tensor | None,
        group_size: int,
        native: Any,
        path: str,
        packed: torch.Tensor,
        scales_minima: torch.Tensor,
    ) -> Int4Map:
        self = cls.__new__(cls)
        _QuantizedMap.__init__(self, out_features, bias)
        self.group_size, self.native, self.path = group_size, native, path
        self.packed, self.scales_minima = packed, scales_minima
        return self

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "bf16":
            return self.native.int4_bf16_matmul(x, self.packed, self.scales_minima)
        if self.path == "vnni":
            return self.native.int4_vnni_matmul(x, self.packed, self.scales_minima)
        if self.path == "avx2":
            return self.native.int4_avx2_matmul(x, self.packed, self.scales_minima)
        return torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_offsets
        )


def _native_kernel() -> Any:
    """cbgen's compiled CPU kernels, or None where they are off or failed to build."""
    from .kernels import decode_kernel

    return decode_kernel()


def _native_4bit(out_features: int, in_features: int, device: torch.device, group_size: int) -> Any:
    """The native module when a map's codes fit its 4-bit layout (groups of a multiple of
    32, outputs in blocks of 16, on the CPU), else None."""
    if group_size % 32 or out_features % 16 or in_features % group_size:
        return None
    return _native_kernel() if device.type == "cpu" else None


def _four_bit_path(native: Any, int8_activations: bool, group_size: int) -> str:
    """Which kernel a 4-bit map runs: ``"vnni"`` (w4a8), ``"bf16"`` (int4), ``"avx2"``
    (int4 on AVX2-only CPUs) or ``"torch"``."""
    global _vnni_warned
    vnni = native is not None and group_size == 32 and native.int4_vnni_available()
    if int8_activations and vnni:
        return "vnni"
    if int8_activations and not _vnni_warned:
        _vnni_warned = True
        why = (
            "its layout or native kernels unavailable"
            if native is None
            else "built with neither AVX512-VNNI nor AVX2"
            if group_size == 32
            else f"groups of {group_size}, not 32"
        )
        logger.warning("cbgen: w4a8 runs the int4 kernel (%s)", why)
    if native is not None and native.int4_bf16_available():
        return "bf16"
    if native is not None and native.int4_avx2_available():
        return "avx2"
    return "torch"


_vnni_warned = False


def shape_fits(out_features: int, in_features: int, mode: str, group_size: int) -> bool:
    """Whether the kernels of ``mode`` take a map of this shape."""
    if mode in FOUR_BIT_MODES:
        # torch's 4-bit CPU layout: input columns in whole groups, outputs in blocks of 16.
        return in_features % group_size == 0 and out_features % 16 == 0
    # torch's int8 kernel reads input columns 16 at a time: with any other count it
    # returns garbage or crashes the process on two rows or more (torch 2.13).
    return in_features % 16 == 0
