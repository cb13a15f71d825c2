"""A compute roofline for decoding: this machine's matmul FLOP/s on the model's own linear maps.

Decoding one token costs about ``2 x (weights of every linear map, LM head included)``
FLOPs (attention over the cache and the element-wise work are left out, which flatters
nobody). ``measure`` times ``F.linear`` on ``[m, in] x [out, in]^T`` for each distinct
weight shape, in the run's dtype and thread count, and also oneDNN's prepacked linear
where it exists (float32 and bfloat16 on CPU: what cbgen itself runs,
``cbgen.executor.cpu.prepack``; bfloat16 without oneDNN's: float32 on widened weights), keeping
the faster of the two per shape, so the roofline is the best matmul this machine offers
rather than the one cbgen happens to use. It reports:

- ``peak_flops``: the FLOP rate of one whole forward's linear maps at ``m`` tokens
  (total FLOPs / total time, each shape weighted by how often it occurs);
- ``best_shape_flops``: the fastest single shape;
- ``ceiling_tok_s``: ``peak_flops / flops_per_token``, the decode throughput a perfect
  engine would reach if nothing but these matmuls took time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..executor.cpu.kernels import decode_kernel
from ..executor.cpu.prepack import (
    PACKED_DTYPES,
    onednn_packs,
    pack_weight,
    packed_linear,
    prepack_supported,
)


def linear_shapes(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Each distinct ``nn.Linear`` weight shape ``(out, in)`` and how many modules have it."""
    counts: Counter[tuple[int, int]] = Counter()
    names: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shape = (int(module.out_features), int(module.in_features))
            counts[shape] += 1
            names.setdefault(shape, name)
    return [
        {"out": o, "in": i, "count": c, "example": names[(o, i)]} for (o, i), c in counts.items()
    ]


def flops_per_token(shapes: list[dict[str, Any]]) -> int:
    return 2 * sum(s["out"] * s["in"] * s["count"] for s in shapes)


def _linear_kernels(w: torch.Tensor, m: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways to run ``x @ w.T`` worth timing for this weight.

    bfloat16 where oneDNN packs none (AVX2-only CPUs) also times the float32 GEMM on the
    weights widened to float32 (a bfloat16 product is exact in float32): torch's own
    bfloat16 GEMM there ran SmolLM2's maps at 64 rows about 6x slower than that, which
    made the roofline a floor and cbgen's share of it over 100%. It is timed beside
    oneDNN's bfloat16 too, and cbgen's float32-FMA kernel where it is built."""
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "F.linear": lambda x: F.linear(x, w)
    }
    if w.device.type != "cpu" or not prepack_supported() or w.dtype not in PACKED_DTYPES:
        return kernels
    if onednn_packs(w.dtype):
        packed = pack_weight(w, m)
        kernels["oneDNN prepacked"] = lambda x: packed_linear(x, packed)
    if w.dtype is torch.bfloat16:
        # Where the float32 FMA units outrun vdpbf16ps (Intel's cores without AMX:
        # bf16_gemm_choice), widened float32 is the better GEMM even beside oneDNN's bf16.
        widened = pack_weight(w.float(), m)
        kernels["oneDNN prepacked, float32 (widened)"] = lambda x: packed_linear(x.float(), widened)
        kernel = decode_kernel()
        if kernel is not None and kernel.bf16_fma_available():
            kernels["cbgen bf16_fma_matmul"] = lambda x: kernel.bf16_fma_matmul(x, w)
    return kernels


def _time_linear(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_time: float, trials: int
) -> float:
    """The best per-call time over ``trials`` timed loops of at least ``min_time`` s."""
    for _ in range(3):
        fn(x)
    calls = 1
    while True:  # calibrate the loop length
        started = time.perf_counter()
        for _ in range(calls):
            fn(x)
        elapsed = time.perf_counter() - started
        if elapsed >= min_time / 4 or calls >= 1 << 16:
            break
        calls *= 2
    calls = max(1, int(calls * (min_time / max(elapsed, 1e-9))))
    best = float("inf")
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


@torch.inference_mode()
def measure(
    shapes: list[dict[str, Any]],
    m: int = 64,
    dtype: torch.dtype = torch.float32,
    min_time: float = 0.2,
    trials: int = 3,
) -> dict[str, Any]:
    if not shapes:
        raise ValueError("the roofline needs the model's nn.Linear shapes, and it has none")
    generator = torch.Generator().manual_seed(0)
    per_shape = []
    total_flops = 0.0
    total_time = 0.0
    for shape in shapes:
        x = torch.randn(m, shape["in"], generator=generator).to(dtype)
        w = torch.randn(shape["out"], shape["in"], generator=generator).to(dtype)
        times = {
            name: _time_linear(fn, x, min_time, trials)
            for name, fn in _linear_kernels(w, m).items()
        }
        kernel = min(times, key=times.__getitem__)
        seconds = times[kernel]
        flops = 2.0 * m * shape["out"] * shape["in"]
        per_shape.append(
            {**shape, "seconds": seconds, "flops_per_s": flops / seconds, "kernel": kernel}
        )
        total_flops += flops * shape["count"]
        total_time += seconds * shape["count"]
    per_token = flops_per_token(shapes)
    peak = total_flops / total_time
    return {
        "m": m,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "shapes": per_shape,
        "flops_per_token": per_token,
        "peak_flops": peak,
        "best_shape_flops": max(s["flops_per_s"] for s in per_shape),
        "ceiling_tok_s": peak / per_token,
    }


def utilization(
    roofline: dict[str, Any] | None, tokens_per_s: float | None
) -> dict[str, float] | None:
    """What fraction of the roofline ``tokens_per_s`` reaches."""
    if not roofline or not tokens_per_s:
        return None
    achieved = roofline["flops_per_token"] * tokens_per_s
    return {"achieved_flops": achieved, "fraction": achieved / roofline["peak_flops"]}
