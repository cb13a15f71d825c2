"""Which kernel runs bfloat16 GEMMs of many rows on this CPU: oneDNN's packed bf16, or
cbgen's ``bf16_fma_matmul`` on the float32 FMA units.

Without AMX, oneDNN's bfloat16 kernels are built on ``vdpbf16ps``, and what that
instruction is worth depends on the core. On AMD Zen 4 it does twice the float32 FMA's
work a cycle; on Intel's Sapphire and Emerald Rapids cores it issues every other cycle
while two float32 FMAs issue every cycle (one core of a 2026-12-07 Xeon, model 207:
``vdpbf16ps`` 92-96 GFLOP/s, ``vfmadd231ps`` 188-192), and torch's float32 GEMM beat its
bfloat16 one there by 1.4-1.9x at 64 and 256 rows. The choice is made once per process
from that measurement (``bf16_dot_fma_rates``, a few milliseconds): it is a property of
the core with a factor of about two either way, so load on the machine does not flip it.
With AMX (``amx_bf16``) oneDNN's tiles win and it stays. ``CBGEN_BF16_GEMM=fma`` or
``=onednn`` decides instead (e.g. to compare the two).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ...sysmem import cpu_signature

logger = logging.getLogger(__name__)

GEMM_ENV = "CBGEN_BF16_GEMM"
# The float32 FMA's GFLOP/s over vdpbf16ps' from which the FMA kernel is taken: it
# reaches a smaller share of its instruction's peak than oneDNN does of its own.
FMA_ADVANTAGE = 1.3


def cpu_has_amx() -> bool:
    """Whether the CPU reports AMX bfloat16 tiles (``amx_bf16`` in ``/proc/cpuinfo``)."""
    return "amx_bf16" in cpu_signature().split()


@functools.cache
def fma_gemm_kernel() -> Any | None:
    """cbgen's native module when bfloat16 maps should run ``bf16_fma_matmul`` beyond the
    row kernel's rows (and keep no oneDNN copy), else None."""
    from .kernels import decode_kernel

    forced = os.environ.get(GEMM_ENV, "").strip().lower()
    if forced not in ("", "fma", "onednn"):
        raise ValueError(f"{GEMM_ENV} must be 'fma' or 'onednn', not {forced!r}")
    if forced == "onednn":
        return None
    kernel = decode_kernel()
    if kernel is None or not kernel.bf16_fma_available():
        if forced == "fma":
            logger.warning("cbgen: %s=fma, but bf16_fma_matmul is not built here", GEMM_ENV)
        return None
    if forced == "fma":
        return kernel
    if cpu_has_amx():
        return None
    dot, fma = kernel.bf16_dot_fma_rates()
    chosen = fma >= FMA_ADVANTAGE * dot
    logger.info(
        "cbgen: one core's vdpbf16ps %.0f GFLOP/s, vfmadd231ps %.0f: bf16 GEMMs on %s",
        dot,
        fma,
        "float32 FMAs (bf16_fma_matmul)" if chosen else "oneDNN",
    )
    return kernel if chosen else None
