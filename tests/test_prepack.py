"""oneDNN prepacked linear maps: same outputs as nn.Linear, applied and undone by the runner."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    file_mapped,
    make_tiny_model,
    random_prompts,
    reference_greedy,
    run_until_done,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.executor.cpu import prepack
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.prepack import (
    DISABLE_ENV,
    NO_FUSE_ENV,
    ROW_COPY_ENV,
    PackedLinears,
    file_backed_ranges,
    onednn_packs,
    packed_linear,
    page_out,
    prepack_enabled_by_default,
    prepack_supported,
    row_copy_wanted,
)
from cbgen.executor.runner import Executor

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


def _overridden(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and "forward" in m.__dict__]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.Linear(160, 40, bias=bias))
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        want = model(x)
        packed = PackedLinears(model)
        assert len(packed) == 2
        got = model(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        packed.restore()
        assert torch.equal(model(x), want)
    assert not _overridden(model)


class _Block(nn.Module):
    """Sibling maps under the names the fusion looks for."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(48, 48, bias=bias)
        self.k_proj = nn.Linear(48, 16, bias=bias)
        self.v_proj = nn.Linear(48, 16, bias=bias)
        self.gate_proj = nn.Linear(48, 96, bias=bias)
        self.up_proj = nn.Linear(48, 96, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_siblings_match_separate_packing_in_any_call_order(bias):
    torch.manual_seed(0)
    block = _Block(bias)
    x, other = torch.randn(1, 64, 48), torch.randn(1, 64, 48)
    names = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    with torch.inference_mode():
        separate = PackedLinears(block, fuse=False)
        assert separate.fused_groups == 0
        want = {n: getattr(block, n)(x) for n in names}
        want_other = block.k_proj(other)
        separate.restore()
        fused = PackedLinears(block)
        assert fused.fused_groups == 2 and len(fused) == 5
        # v before q, and k on another input in between: each gets its own columns.
        for name in ["v_proj", "up_proj", "q_proj", "gate_proj", "k_proj"]:
            assert torch.equal(getattr(block, name)(x), want[name]), name
        assert torch.equal(block.k_proj(other), want_other)
        assert torch.equal(block.q_proj(x), want["q_proj"])
        assert torch.equal(block.k_proj(x), want["k_proj"])
        fused.restore()
    assert not _overridden(block)


def test_fusion_env_switch(monkeypatch):
    monkeypatch.setenv(NO_FUSE_ENV, "1")
    block = _Block(bias=False)
    packed = PackedLinears(block)
    assert packed.fused_groups == 0 and len(packed) == 5
    packed.restore()
    monkeypatch.delenv(NO_FUSE_ENV)
    packed = PackedLinears(block)
    assert packed.fused_groups == 2
    packed.restore()


def test_fused_model_logits_are_bitwise_those_of_separate_packing():
    model = make_tiny_model("llama")
    ids = torch.tensor([random_prompts(1, 20, 20, seed=3)[0]])
    with torch.inference_mode():
        separate = PackedLinears(model, fuse=False)
        want = model(ids).logits
        separate.restore()
        fused = PackedLinears(model)
        assert fused.fused_groups == 2 * model.config.num_hidden_layers
        got = model(ids).logits
        fused.restore()
    assert torch.equal(got, want)


def test_unpackable_calls_fall_back():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    packed = PackedLinears(layer)
    x = torch.randn(4, 32, requires_grad=True)
    out = layer(x)  # autograd: the plain path, so backward works
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        assert layer(torch.randn(0, 32)).shape == (0, 16)
    packed.restore()


def test_only_modules_of_the_packed_dtype_are_packed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    packed = PackedLinears(model)
    assert len(packed) == 1 and "forward" not in model[1].__dict__
    packed.restore()
    packed = PackedLinears(model, dtype=torch.bfloat16)
    assert len(packed) == 1 and "forward" not in model[0].__dict__
    packed.restore()
    with pytest.raises(ValueError, match="packs"):
        PackedLinears(model, dtype=torch.float16)
    assert prepack_enabled_by_default(nn.Linear(4, 4))
    assert prepack_enabled_by_default(nn.Linear(4, 4).to(torch.bfloat16))
    assert not prepack_enabled_by_default(nn.Linear(4, 4).to(torch.float16))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bf16_packed_linear_matches_float32_reference(rows):
    """bfloat16 weights and inputs, float32 accumulation: within a few bfloat16 ulps of the
    float32 product of the same (rounded) numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 40)).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        first = model[0]
        want = F.linear(x.float(), first.weight.float(), first.bias.float())
        packed = PackedLinears(model, dtype=torch.bfloat16)
        got = first(x)
        packed.restore()
    assert got.dtype == torch.bfloat16
    # One rounding of the float32 sum to bfloat16 (8 bits of mantissa): 2^-8 relative.
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)


def test_env_switch(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not prepack_enabled_by_default(nn.Linear(4, 4))


@pytest.mark.parametrize("prepack", [None, True, False])
def test_runner_applies_and_restores(prepack, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    model = make_tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runner = Executor(model, use_native_kernels=False, prepack_linear=prepack)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert runner.prepacked_linears == (0 if prepack is False else linears)
    assert len(_overridden(model)) == runner.prepacked_linears
    assert model.state_dict().keys() == state.keys()
    runner.close()
    runner.close()  # idempotent
    assert not _overridden(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_engine_greedy_matches_generate_with_prepack(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    model = make_tiny_model("llama")
    prompts = random_prompts(5, 3, 40, seed=11)
    expected = [reference_greedy(model, p, 16) for p in prompts]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64)
    with cbgen.EngineCore(model, config) as engine:
        assert engine.executor.runner.prepacked_linears > 0
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=16), request_id=str(i))
        results = {rid: out.token_ids for rid, out in run_until_done(engine).items()}
    assert [results[str(i)] for i in range(len(prompts))] == expected
    assert not _overridden(model)


def _resident_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_page_out_hands_file_pages_back_and_keeps_the_values(tmp_path):
    weight = torch.randn(4096, 4096)  # 64 MiB
    mapped = file_mapped(tmp_path, weight)
    expected = float(weight.sum())
    assert float(mapped.sum()) == expected  # every page is resident now
    before = _resident_bytes()
    released = page_out(mapped, file_backed_ranges())
    after = _resident_bytes()
    assert released >= 64 * 2**20 - 2 * mmap.PAGESIZE
    assert before - after > 48 * 2**20
    assert float(mapped.sum()) == expected  # mapped again from the page cache
    assert page_out(weight, file_backed_ranges()) == 0  # anonymous memory stays put
    mapped[100, 0] = 7.0  # a private copy of that page now: dropping it would revert it
    assert page_out(mapped, file_backed_ranges()) == 0
    assert float(mapped[100, 0]) == 7.0


def test_packing_a_file_backed_model_releases_its_original_weights(smollm2):
    model, _ = smollm2
    embedding = model.get_input_embeddings()
    ids = torch.tensor([1, 500, 20000, 49151])
    rows = embedding.weight[ids].clone()
    packed = PackedLinears(model)
    try:
        weights = {
            m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, nn.Linear)
        }
        linear_bytes = sum(w.numel() * 4 for w in weights.values())  # the tied LM head once
        assert linear_bytes > 500 * 2**20
        assert packed.released_bytes > 0.95 * linear_bytes
        with torch.inference_mode():  # the embedding maps its rows again from the page cache
            assert torch.equal(embedding(ids), rows)
    finally:
        packed.restore()


needs_row_kernel = pytest.mark.skipif(
    decode_kernel() is None or not decode_kernel().bf16_rows_available(),
    reason="no native bf16 row kernel (AVX512-BF16 or AVX2) here",
)


@needs_row_kernel
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 8),
    out_features=st.integers(1, 40),
    in_features=st.integers(1, 200),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_row_kernel_is_the_product_to_one_rounding(
    rows, out_features, in_features, bias, seed
):
    """Any shape, tails included: the exact product of the bfloat16 numbers (and the
    bias, added before rounding), summed in float32 and rounded once to bfloat16."""
    _assert_bf16_product("bf16_rows_matmul", rows, out_features, in_features, bias, seed)


@needs_row_kernel
def test_bf16_row_kernel_gives_a_row_alone_the_bits_it_gets_in_a_batch():
    """A row's sums must not depend on the rows beside it (the AVX2 build takes the rows
    in pairs over each weight row), at any batch size and any column count (tails of
    the 32- and 16-column steps included)."""
    kernel = decode_kernel()
    generator = torch.Generator().manual_seed(1)
    for in_features in (7, 16, 48, 75, 576):
        weight = torch.randn(37, in_features, generator=generator).to(torch.bfloat16)
        bias = torch.randn(37, generator=generator).to(torch.bfloat16)
        x = torch.randn(8, in_features, generator=generator).to(torch.bfloat16)
        for rows in range(1, 9):
            batched = kernel.bf16_rows_matmul(x[:rows], weight, bias)
            for row in range(rows):
                alone = kernel.bf16_rows_matmul(x[row : row + 1].contiguous(), weight, bias)
                assert torch.equal(alone[0].view(torch.int16), batched[row].view(torch.int16))
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernel.bf16_rows_matmul(
            torch.zeros(9, 16, dtype=torch.bfloat16), weight[:, :16].contiguous(), None
        )


def _assert_bf16_product(
    kernel: str, rows: int, out_features: int, in_features: int, bias: bool, seed: int
) -> None:
    """The native ``kernel`` on random bfloat16 inputs is the float64 product (and bias)
    to one bfloat16 rounding, with float32 sums' error in the magnitudes' scale."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    got = getattr(decode_kernel(), kernel)(x, weight, b).double()
    want = x.double() @ weight.double().t() + (b.double() if bias else 0)
    magnitude = x.double().abs() @ weight.double().abs().t() + (b.double().abs() if bias else 0)
    assert bool(((got - want).abs() <= 2**-8 * want.abs() + 2**-20 * magnitude).all())


needs_lanes_kernel = pytest.mark.skipif(
    decode_kernel() is None or not decode_kernel().bf16_avx2_available(),
    reason="bf16_avx2_matmul is built for AVX2 CPUs without AVX512-BF16 only",
)


@needs_lanes_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 140),
    out_features=st.integers(1, 40),
    in_features=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_lanes_kernel_is_the_product_to_one_rounding(
    rows, out_features, in_features, bias, seed
):
    """AVX2's batch kernel for plain bf16 weights, at any shape: partial vectors of rows
    (fewer than 8, 32 or 128 of them), odd weight rows, columns that are no multiple of
    8 or of its 128-column chunks. Each output is the float32 sum of exact products and
    the bias, rounded once to bfloat16."""
    _assert_bf16_product("bf16_avx2_matmul", rows, out_features, in_features, bias, seed)


@needs_lanes_kernel
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(2, 140), seed=st.integers(0, 2**16))
def test_bf16_lanes_kernel_gives_a_row_alone_the_bits_it_gets_in_a_batch(rows, seed):
    """Each output's sum runs along the columns in order whatever the rows beside it, so
    a request's logits do not depend on the batch it decodes in (to the bit)."""
    _assert_rows_alone_match_the_batch("bf16_avx2_matmul", 37, rows, seed)


def _assert_rows_alone_match_the_batch(
    kernel_name: str, out_features: int, rows: int, seed: int
) -> torch.Tensor:
    """The first, middle and last of ``rows`` rows alone get the bits they get together;
    returns the batch's output."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, 300, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 300, generator=generator).to(torch.bfloat16)
    kernel = getattr(decode_kernel(), kernel_name)
    batched = kernel(x, weight, None)
    for row in (0, rows // 2, rows - 1):
        alone = kernel(x[row : row + 1].contiguous(), weight, None)
        assert torch.equal(alone[0].view(torch.int16), batched[row].view(torch.int16))
    return batched


needs_fma_kernel = pytest.mark.skipif(
    decode_kernel() is None or not decode_kernel().bf16_fma_available(),
    reason="bf16_fma_matmul is built for AVX-512 CPUs only",
)


@needs_fma_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 200),
    out_features=st.integers(1, 110),
    in_features=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_fma_kernel_is_the_product_to_one_rounding(
    rows, out_features, in_features, bias, seed
):
    """AVX-512's float32-FMA kernel for plain bf16 weights, at any shape: partial vectors
    of rows (fewer than 16, 64 or 128 of them), weight rows past its 96-row blocks and
    its 6- to 12-row tiles, columns that are no multiple of 16 or of its 128-column
    chunks. Each output is the float32 sum of exact products and the bias, rounded once
    to bfloat16."""
    _assert_bf16_product("bf16_fma_matmul", rows, out_features, in_features, bias, seed)


@needs_fma_kernel
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(2, 200), seed=st.integers(0, 2**16))
def test_bf16_fma_kernel_gives_a_row_alone_the_bits_it_gets_in_a_batch(rows, seed):
    """Each output's sum runs along the columns in order whatever the rows beside it
    (and however many threads run it), so a request's logits do not depend on the batch
    it decodes in (to the bit)."""
    batched = _assert_rows_alone_match_the_batch("bf16_fma_matmul", 101, rows, seed)
    generator = torch.Generator().manual_seed(seed)  # the same weight and rows again
    weight = torch.randn(101, 300, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 300, generator=generator).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode_kernel().bf16_fma_matmul(x, weight, None), batched)
    finally:
        torch.set_num_threads(threads)


@needs_fma_kernel
def test_bf16_fma_kernel_refuses_what_it_cannot_take():
    kernel = decode_kernel()
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 12 columns, weight 16"):
        kernel.bf16_fma_matmul(torch.zeros(20, 12, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        kernel.bf16_fma_matmul(torch.zeros(20, 16, dtype=torch.bfloat16), weight.t(), None)
    with pytest.raises(RuntimeError, match="bias has 3 values for 8 outputs"):
        kernel.bf16_fma_matmul(
            torch.zeros(20, 16, dtype=torch.bfloat16), weight, torch.zeros(3, dtype=torch.bfloat16)
        )
    assert kernel.bf16_fma_matmul(torch.zeros(0, 16, dtype=torch.bfloat16), weight).shape == (0, 8)


@needs_fma_kernel
@pytest.mark.parametrize("row_copy", ["0", "1"])
def test_bf16_maps_on_the_fma_kernel_keep_one_plain_copy(monkeypatch, row_copy):
    """Where the float32 FMA units outrun ``vdpbf16ps`` (forced here) a bf16 map keeps
    the plain weight alone, whatever the row-copy setting, and no oneDNN copy: 1-8
    rows on the row kernel, more on ``bf16_fma_matmul``, bit for bit."""
    monkeypatch.setattr(prepack, "fma_gemm_kernel", decode_kernel)
    monkeypatch.setenv(ROW_COPY_ENV, row_copy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 40)).to(torch.bfloat16)
    packed = PackedLinears(model, dtype=torch.bfloat16)
    linear_map = packed.packed_weight(model[0])
    assert linear_map.packed is None and linear_map.weight is not None
    assert linear_map.row_kernel_rows == prepack.PLAIN_ROW_KERNEL_ROWS
    kernel = decode_kernel()
    with torch.inference_mode():
        for rows in (1, 8, 9, 64, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            name = "bf16_rows_matmul" if rows <= 8 else "bf16_fma_matmul"
            want = getattr(kernel, name)(x, linear_map.weight, model[0].bias)
            assert torch.equal(model[0](x), want)
        x = torch.randn(2, 30, 96).to(torch.bfloat16)  # rows with a leading batch shape
        assert torch.equal(model[0](x), model[0](x.reshape(60, 96)).view(2, 30, 160))
    packed.restore()


@needs_row_kernel
def test_bf16_maps_run_a_few_rows_on_the_row_kernel_and_more_on_onednn(monkeypatch):
    """With the row copy, 1-4 rows are the row kernel's output and 5 or more oneDNN's,
    bit for bit; without it (``CBGEN_BF16_ROW_COPY=0``) every call is oneDNN's. Where
    oneDNN cannot pack bfloat16 (an AVX2-only CPU) the plain weight serves both: the row
    kernel, then ``F.linear``."""
    if not onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 on this CPU: see the plain-weight test")
    monkeypatch.setattr(prepack, "fma_gemm_kernel", lambda: None)  # oneDNN's batches
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 40)).to(torch.bfloat16)
    monkeypatch.setenv(ROW_COPY_ENV, "1")
    packed = PackedLinears(model, dtype=torch.bfloat16)
    linear_map = packed.packed_weight(model[0])
    assert packed.row_copy and linear_map.weight is not None
    with torch.inference_mode():
        for rows in (1, 3, 4, 5, 64):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            got = model[0](x)
            if rows <= prepack.ROW_KERNEL_ROWS:
                want = decode_kernel().bf16_rows_matmul(x, linear_map.weight, model[0].bias)
            else:
                want = packed_linear(x, linear_map.packed, model[0].bias)
            assert torch.equal(got, want)
    packed.restore()
    monkeypatch.setenv(ROW_COPY_ENV, "0")
    packed = PackedLinears(model, dtype=torch.bfloat16)
    linear_map = packed.packed_weight(model[0])
    assert not packed.row_copy and linear_map.weight is None
    x = torch.randn(1, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model[0](x), packed_linear(x, linear_map.packed, model[0].bias))
    packed.restore()


@needs_row_kernel
@pytest.mark.parametrize("row_copy", ["0", "1"])
def test_bf16_maps_keep_plain_weights_where_onednn_cannot_pack_them(monkeypatch, row_copy):
    """An AVX2-only CPU (oneDNN packs no bfloat16 there; forced here on any CPU) still
    serves bfloat16 maps, fused as elsewhere, from the one plain copy whatever the
    row-copy setting: 1-8 rows on the row kernel, more on ``bf16_avx2_matmul`` where it
    is built (else widened to float32, ``widened_linear``), bit for bit; each is the
    float32 product to one bfloat16 rounding."""
    monkeypatch.setattr(prepack, "onednn_packs", lambda dtype: dtype is not torch.bfloat16)
    monkeypatch.setattr(prepack, "fma_gemm_kernel", lambda: None)  # AVX-512's: see below
    monkeypatch.setenv(ROW_COPY_ENV, row_copy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 40)).to(torch.bfloat16)
    packed = PackedLinears(model, dtype=torch.bfloat16)
    linear_map = packed.packed_weight(model[0])
    assert len(packed) == 2 and linear_map.packed is None
    lanes = decode_kernel().bf16_avx2_available()
    assert (linear_map.lanes_kernel is not None) == lanes
    assert linear_map.row_kernel_rows == prepack.PLAIN_ROW_KERNEL_ROWS == 8
    with torch.inference_mode():
        for rows in (1, 4, 5, 8, 9, 64, 127, 128, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            got = model[0](x)
            if rows <= prepack.PLAIN_ROW_KERNEL_ROWS:
                want = decode_kernel().bf16_rows_matmul(x, linear_map.weight, model[0].bias)
            else:
                if lanes:
                    kernel = decode_kernel()
                    want = kernel.bf16_avx2_matmul(x, linear_map.weight, model[0].bias)
                else:
                    want = prepack.widened_linear(x, linear_map.weight, model[0].bias)
                exact = F.linear(x.float(), model[0].weight.float(), model[0].bias.float())
                # float32 sums in another order: one bfloat16 rounding apart at most
                torch.testing.assert_close(want.float(), exact, rtol=2**-8, atol=1e-6)
            assert torch.equal(got, want)
        x = torch.randn(2, 3, 96).to(torch.bfloat16)  # rows with a leading batch shape
        assert torch.equal(model[0](x), model[0](x.reshape(6, 96)).view(2, 3, 160))
    packed.restore()


@needs_row_kernel
def test_a_models_own_forward_runs_its_decode_rows_on_the_row_kernel(monkeypatch):
    """A model's own forward (every model the fast decoder does not build) passes
    ``[batch, tokens, hidden]``: its few decode rows take the row kernel as the fast
    decoder's 2-D rows do, not the kernel for many rows (Gemma 3 270M in bfloat16 on an
    AVX2 CPU had spent 91 of its 105 ms a token there)."""
    monkeypatch.setenv(ROW_COPY_ENV, "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160)).to(torch.bfloat16)
    packed = PackedLinears(model, dtype=torch.bfloat16)
    linear_map = packed.packed_weight(model[0])
    kernel = linear_map.rows_kernel
    assert kernel is not None
    rows_seen = []

    class RecordingKernel:  # the real kernel, noting the rows of each call
        def bf16_rows_matmul(self, x, weight, bias):
            rows_seen.append(tuple(x.shape))
            return kernel.bf16_rows_matmul(x, weight, bias)

    linear_map.rows_kernel = RecordingKernel()
    with torch.inference_mode():
        for shape in ((1, 1, 96), (2, 1, 96), (1, 3, 96)):
            x = torch.randn(shape).to(torch.bfloat16)
            got = model[0](x)
            want = kernel.bf16_rows_matmul(x.reshape(-1, 96), linear_map.weight, model[0].bias)
            assert torch.equal(got, want.view(*shape[:-1], 160))
    assert rows_seen == [(1, 96), (2, 96), (3, 96)]
    packed.restore()


def test_the_row_copy_is_kept_while_it_is_a_small_share_of_memory(monkeypatch):
    monkeypatch.delenv(ROW_COPY_ENV, raising=False)
    monkeypatch.setattr(prepack, "meminfo_kib", lambda field: 8 * 2**20)  # 8 GiB
    assert row_copy_wanted(2**30)  # 1 GiB: an eighth
    assert not row_copy_wanted(2**30 + 1)
    monkeypatch.setenv(ROW_COPY_ENV, "1")
    assert row_copy_wanted(2**40)
    monkeypatch.setenv(ROW_COPY_ENV, "0")
    assert not row_copy_wanted(1)
    monkeypatch.delenv(ROW_COPY_ENV)
    monkeypatch.setattr(prepack, "meminfo_kib", lambda field: None)  # not Linux: no copy
    assert not row_copy_wanted(1)
