"""Which kernel serves bfloat16 GEMMs of many rows: measured once, forced by the env."""

import pytest

from cbgen.executor.cpu import bf16_gemm_choice
from cbgen.executor.cpu.bf16_gemm_choice import FMA_ADVANTAGE, GEMM_ENV, fma_gemm_kernel
from cbgen.executor.cpu.kernels import decode_kernel

needs_fma_kernel = pytest.mark.skipif(
    decode_kernel() is None or not decode_kernel().bf16_fma_available(),
    reason="bf16_fma_matmul is built for AVX-512 CPUs only",
)


@pytest.fixture(autouse=True)
def fresh_choice():
    fma_gemm_kernel.cache_clear()
    yield
    fma_gemm_kernel.cache_clear()


def test_the_env_forces_onednn_and_refuses_other_names(monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "onednn")
    assert fma_gemm_kernel() is None
    fma_gemm_kernel.cache_clear()
    monkeypatch.setenv(GEMM_ENV, "amx")
    with pytest.raises(ValueError, match="must be 'fma' or 'onednn', not 'amx'"):
        fma_gemm_kernel()


@needs_fma_kernel
def test_the_env_forces_the_fma_kernel_even_beside_amx(monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "FMA")
    monkeypatch.setattr(bf16_gemm_choice, "cpu_has_amx", lambda: True)
    assert fma_gemm_kernel() is decode_kernel()


@needs_fma_kernel
def test_amx_keeps_onednn(monkeypatch):
    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.setattr(bf16_gemm_choice, "cpu_has_amx", lambda: True)
    assert fma_gemm_kernel() is None


@needs_fma_kernel
def test_the_measured_rates_decide_and_are_real_throughputs(monkeypatch):
    """The probe times real instructions (a positive float32 FMA rate wherever the kernel
    is built; no floor, so a slow or loaded machine passes too), and the choice follows
    its ratio to vdpbf16ps' rate (0 where the build has no AVX512-BF16, so the FMA
    kernel is taken there)."""
    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.setattr(bf16_gemm_choice, "cpu_has_amx", lambda: False)
    dot, fma = decode_kernel().bf16_dot_fma_rates()
    assert fma > 0 and dot >= 0
    chosen = fma_gemm_kernel() is not None
    # Rates measured again can differ a little; the two cores known differ by ~2x.
    if fma >= 1.1 * FMA_ADVANTAGE * dot:
        assert chosen
    elif fma <= 0.9 * FMA_ADVANTAGE * dot:
        assert not chosen


def test_amx_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(bf16_gemm_choice, "cpu_signature", lambda: "flags : fpu amx_bf16 avx")
    assert bf16_gemm_choice.cpu_has_amx()
    monkeypatch.setattr(bf16_gemm_choice, "cpu_signature", lambda: "flags : fpu avx512_bf16")
    assert not bf16_gemm_choice.cpu_has_amx()
