"""Weight-only int8 and 4-bit linear maps (``cbgen.executor.cpu.quantization``): the codes against the
weights they stand for, the kernels against a float32 reference on random shapes, and
quantized models through the engine's paths."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import fast_path_errors, file_mapped, make_tiny_model, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cbgen import EngineConfig, SamplingParams, generate_batch
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.model_quantization import quantize_model
from cbgen.executor.cpu.prepack import PackedLinears
from cbgen.executor.cpu.quantization import (
    Int4Map,
    QuantizedLinear,
    dequantize,
    quantize_int4,
    quantize_int8,
    validate_mode,
)

# The kernels take bfloat16 activations and accumulate in float32; against the float32
# product of the dequantized weight and the bfloat16-rounded input, the error is the
# output's one rounding to bfloat16 plus the scales' (2^-8 relative each).
KERNEL_RTOL = 2**-6


def _reference(module: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """What the module's kernel computes, in float32: the dequantized weight times the
    bfloat16-rounded input. The VNNI 4-bit kernel (w4a8) multiplies the codes by the
    input quantized to int8 per group of 32 (its scale the group's largest magnitude over
    127) and the minima by the input's exact group sums."""
    bias = module.bias.float() if module.bias is not None else None
    rows = x.to(torch.bfloat16).float().reshape(-1, x.shape[-1])
    if getattr(module.kernel(), "path", None) != "vnni":
        return F.linear(rows, dequantize(module), bias).view(*x.shape[:-1], -1)
    codes, scales, minima = module.unpacked()  # scales and minima bfloat16, as kernels keep
    groups = codes.float().view(codes.shape[0], -1, 32)
    weight = (groups * scales[..., None] + minima[..., None]).view(codes.shape[0], -1)
    quantized = _int8_groups(rows)
    out = F.linear(quantized, weight, bias)
    lost = (rows - quantized).view(rows.shape[0], -1, 32).sum(dim=-1)  # [rows, groups]
    out += lost @ minima.t()
    return out.view(*x.shape[:-1], -1)


def _int8_groups(rows: torch.Tensor) -> torch.Tensor:
    groups = rows.view(rows.shape[0], -1, 32)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(groups / scale), torch.zeros_like(groups))
    return (codes * scale).view_as(rows)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-6))


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(["int8", "int4", "w4a8"]),
    out_blocks=st.integers(1, 6),
    in_groups=st.integers(1, 6),
    rows=st.integers(1, 70),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernels_match_the_dequantized_float32_product(
    mode, out_blocks, in_groups, rows, bias, dtype
):
    torch.manual_seed(out_blocks * 100 + in_groups * 10 + rows)
    linear = nn.Linear(32 * in_groups, 16 * out_blocks, bias=bias)
    module = QuantizedLinear.from_linear(linear, mode)
    x = torch.randn(rows, linear.in_features).to(dtype)
    with torch.inference_mode():
        got = module(x)
    assert got.dtype == dtype and got.shape == (rows, linear.out_features)
    assert _relative_error(got, _reference(module, x)) < KERNEL_RTOL


def test_codes_stand_for_the_weights():
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    before = weight.clone()
    codes, scales = quantize_int8(weight)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    # Rounding to the nearest code: within half a step of each channel's scale.
    assert bool(
        ((codes.float() * scales[:, None] - weight).abs() <= scales[:, None] / 2 + 1e-6).all()
    )
    codes4, scales4, minima = quantize_int4(weight, 32)
    assert int(codes4.max()) == 15 and int(codes4.min()) == 0
    rebuilt = codes4.float().view(64, 4, 32) * scales4[..., None] + minima[..., None]
    error = (rebuilt.view(64, 128) - weight).abs().view(64, 4, 32)
    assert bool((error <= scales4[..., None] / 2 + 1e-5).all())
    # The quantizers work in place on a copy: a float32 weight is not touched.
    assert torch.equal(weight, before)


def test_int4_finds_a_q4_1_grid_back():
    """Weights already on a Q4_1 grid (a scale and a minimum per 32 columns, codes 0..15
    with both ends used), as the bundled GGUF's are once dequantized: 4-bit quantization
    recovers them up to the bfloat16 rounding of the scales."""
    torch.manual_seed(1)
    scales = torch.rand(48, 2) * 0.01 + 0.001
    minima = -torch.rand(48, 2) * 0.05
    codes = torch.randint(0, 16, (48, 2, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    weight = (codes * scales[..., None] + minima[..., None]).view(48, 64)
    module = QuantizedLinear.from_linear(_with_weight(weight), "int4")
    got_codes, got_scales, got_minima = module.unpacked()
    assert torch.equal(got_codes.view(48, 2, 32), codes.to(torch.uint8))
    assert torch.allclose(got_scales, scales, rtol=2**-8, atol=0)
    assert torch.allclose(got_minima, minima, rtol=2**-8, atol=0)
    rounded = (codes * got_scales[..., None] + got_minima[..., None]).view(48, 64)
    assert torch.allclose(dequantize(module), rounded, atol=1e-6)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        got = module(x)
    want = F.linear(x.to(torch.bfloat16).float(), weight)
    assert _relative_error(got, want) < KERNEL_RTOL


def _with_weight(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    return linear


def test_bad_modes_and_group_sizes_are_refused():
    with pytest.raises(ValueError, match="int8"):
        validate_mode("int3")
    assert validate_mode(None) is None and validate_mode("int4") == "int4"
    with pytest.raises(ValueError, match="group_size"):
        quantize_model(nn.Sequential(nn.Linear(64, 16)), "int4", group_size=48)


def test_quantize_model_replaces_linears_and_keeps_unfit_shapes():
    model = nn.ModuleList(
        [nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 16), nn.Linear(96, 16)]
    )
    # 24 outputs are not blocks of 16; 24 inputs are not groups of 32.
    assert quantize_model(model, "int4") == 2
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[3], QuantizedLinear)
    assert type(model[1]) is nn.Linear and type(model[2]) is nn.Linear
    # torch's int8 kernel wants input columns in blocks of 16 (else it crashes at 2+ rows).
    odd = nn.ModuleList([nn.Linear(24, 8), nn.Linear(32, 8)])
    assert quantize_model(odd, "int8") == 1 and type(odd[0]) is nn.Linear
    with torch.inference_mode():
        assert odd[0](torch.randn(5, 24)).shape == (5, 8)
    assert "mode=int4, group_size=32" in repr(model[0])
    assert set(model[0].state_dict()) == {"codes", "scales_minima", "bias"}


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_fused_siblings_equal_separate_kernels(mode):
    """q/k/v served by one kernel over concatenated codes: the same columns as each alone.
    A 4-bit group stacks its members' packed blocks (built by their own calls first) and
    holds the bytes that packing the joined codes again gives."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, n) for n in (64, 32, 32))

    torch.manual_seed(2)
    block = Block()
    quantize_model(block, mode)
    members = [block.q_proj, block.k_proj, block.v_proj]
    before = [m.unpacked() for m in members] if mode != "int8" else []
    x = torch.randn(5, 64)
    with torch.inference_mode():
        alone = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
        packed = PackedLinears(block)
        assert packed.fused_groups == 1
        # The members' own kernels (built by the calls above) give way to the group's.
        assert all(m._map is None for m in (block.q_proj, block.k_proj, block.v_proj))
        fused = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
        if mode != "int8":
            group = packed.fused_weight(tuple(members))
            parts = [m.unpacked() for m in members]
            repacked = Int4Map(  # the joined codes packed afresh
                *(torch.cat([part[i] for part in parts]) for i in range(3)),
                32,
                None,
                int8_activations=mode == "w4a8",
            )
            assert group.path == repacked.path and group.out_features == 128
            assert torch.equal(group.packed, repacked.packed)
            if group.path != "torch":
                assert torch.equal(group.scales_minima, repacked.scales_minima)
                # The members hold views of the group's tensors, not copies of their own.
                for member in members:
                    for mine, its in (
                        (member.codes, group.packed),
                        (member.scales_minima, group.scales_minima),
                    ):
                        assert mine.untyped_storage().data_ptr() == its.untyped_storage().data_ptr()
        packed.restore()
        after = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]  # each from its view
    for a, b, c in zip(alone, fused, after, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    for member, was in zip(members if before else [], before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(member.unpacked(), was, strict=True))


needs_kernel = pytest.mark.skipif(decode_kernel() is None, reason="native kernels not built")


@pytest.mark.parametrize("mode", ["int4", "w4a8"])
@pytest.mark.parametrize("native", [True, False])
def test_a_4bit_module_holds_the_codes_its_kernel_reads(mode, native):
    """A 4-bit module keeps its codes in its kernel's layout and bfloat16 scales and
    minima, and the kernel serves from those very tensors (no second copy); unpacked()
    gives back the quantizer's codes and its scales and minima rounded to bfloat16, on
    the native layouts and on torch's (the kernels off)."""
    from cbgen.executor.cpu import quantization

    torch.manual_seed(7)
    linear = nn.Linear(128, 48, bias=False)
    with pytest.MonkeyPatch.context() as patch:
        if not native:
            patch.setattr(quantization, "_native_kernel", lambda: None)
        module = QuantizedLinear.from_linear(linear, mode)
        kernel = module.kernel()
    if kernel.path == "torch":
        assert module.layout == "rows" and module.codes.shape == (48, 64)
    else:
        assert module.layout == ("quads" if kernel.path == "vnni" else "pairs")
        assert kernel.packed is module.codes and kernel.scales_minima is module.scales_minima
    assert native or module.layout == "rows"
    codes, scales, minima = quantize_int4(linear.weight)
    got = module.unpacked()
    assert torch.equal(got[0], codes)
    assert torch.equal(got[1], scales.to(torch.bfloat16).float())
    assert torch.equal(got[2], minima.to(torch.bfloat16).float())
    assert module.scales_minima.dtype == torch.bfloat16
    assert module.scales_minima.shape == (3, 4, 32)


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_models_run_the_fast_decoder_close_to_their_module_forward(mode, dtype):
    """The fast decoder serves a quantized Llama (bfloat16 or float32 around the quantized
    GEMMs): every step's logits within 5% (relative norm) of the model's own forward.

    In bfloat16 the two paths round a few activations differently (the fused norms), and
    w4a8's int8 activations turn such a difference into a whole int8 step now and then:
    about 5% mean and 8.3% worst here, against int4's 1.2% and 1.5%; in float32 both
    paths agree exactly."""
    model = make_tiny_model("llama").to(dtype)
    quantize_model(model, mode)
    errors = fast_path_errors(model, random_prompts(4, 3, 20, seed=4), max_new_tokens=5)
    bound = 0.12 if mode == "w4a8" and dtype == torch.bfloat16 else 0.05
    assert errors and max(errors) < bound, errors


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_through_generate_batch_on_the_module_path(mode, monkeypatch):
    """Any architecture: transformers' modules call the quantized maps (Phi-3 has fused
    qkv_proj and gate_up_proj of its own, outside the fast decoder)."""
    model = make_tiny_model("phi3").to(torch.bfloat16)
    assert quantize_model(model, mode) > 0
    prompts = random_prompts(6, 2, 20, seed=5)
    outputs = generate_batch(model, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [8] * 6


def test_load_model_quantizes_the_bundled_model():
    """``load_model(..., quantization=...)``: bfloat16 around int4 layer maps and an int8 LM
    head; greedy output on a real prompt agrees with float32's for its first tokens."""
    import cbgen

    model, tokenizer = cbgen.load_model("smollm2", quantization="int4")
    kinds = {m.mode for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"int4", "int8"} and model.lm_head.mode == "int8"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    reference, _ = cbgen.load_model("smollm2", tokenizer=False)
    prompt = tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    got = generate_batch(model, [prompt], params)[0].token_ids
    want = generate_batch(reference, [prompt], params)[0].token_ids
    assert got[:2] == want[:2], (tokenizer.decode(got), tokenizer.decode(want))
    with pytest.raises(ValueError, match="quantization must be one of"):
        cbgen.load_model("smollm2", quantization="fp4")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_through_the_online_engine_and_the_server(mode):
    """A quantized model behind the OpenAI-compatible server, asked by the openai client."""
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from test_server import smollm2_tokenizer, tiny_model, uvicorn_in_thread

    from cbgen.frontends.online import Engine
    from cbgen.frontends.server import create_app

    tokenizer = smollm2_tokenizer()
    model = tiny_model(tokenizer).to(torch.bfloat16)
    quantize_model(model, mode)
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=32, block_size=16))
    try:
        app = create_app(engine, tokenizer, "tiny-quantized")
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        with uvicorn_in_thread(uv) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            reply = client.completions.create(
                model="tiny-quantized", prompt="Hello there", max_tokens=5, temperature=0
            )
            assert reply.usage.completion_tokens == 5 and reply.choices[0].text
    finally:
        engine.close()


@needs_kernel
def test_a_4bit_lm_head_is_an_option():
    """``lm_head="int4"``: the head's codes are 4-bit too, and the fast decoder serves it
    as closely as the int8 head (its quality cost on SmolLM2 is in bench/quality.py)."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    quantize_model(model, "int4", lm_head="int4")
    assert model.lm_head.mode == "int4" and model.model.layers[0].mlp.down_proj.mode == "int4"
    errors = fast_path_errors(model, random_prompts(4, 3, 20, seed=4), max_new_tokens=5)
    assert errors and max(errors) < 0.05, errors
    with pytest.raises(ValueError, match="lm_head must be one of"):
        quantize_model(make_tiny_model("llama"), "int4", lm_head="int2")


def test_load_model_takes_the_lm_head_option_with_quantization_only():
    import cbgen

    model, _ = cbgen.load_model(
        "smollm2", quantization="int8", lm_head_quantization="int4", tokenizer=False
    )
    assert model.lm_head.mode == "int4" and model.model.layers[0].self_attn.q_proj.mode == "int8"
    with pytest.raises(ValueError, match="lm_head_quantization needs quantization"):
        cbgen.load_model("smollm2", lm_head_quantization="int4")
    with pytest.raises(ValueError, match="lm_head_quantization must be one of"):
        cbgen.load_model("smollm2", quantization="int4", lm_head_quantization="fp4")


def test_load_model_takes_a_4bit_group_size():
    """``quantization_group_size`` reaches every 4-bit map (and a 4-bit head), the int8
    head keeps one scale a row, and the option is refused where it means nothing: with
    no 4-bit mode, with w4a8 (activations in groups of 32), or an unsupported size."""
    import cbgen
    from cbgen.frontends.args.precision import add_precision_arguments

    model, _ = cbgen.load_model(
        "smollm2", quantization="int4", quantization_group_size=64, tokenizer=False
    )
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.group_size == 64 and q_proj.scales_minima.shape == (576 // 16, 576 // 64, 32)
    assert model.lm_head.mode == "int8"
    with pytest.raises(ValueError, match="4-bit modes"):
        cbgen.load_model("smollm2", quantization="int8", quantization_group_size=64)
    with pytest.raises(ValueError, match="groups? of 32"):
        cbgen.load_model("smollm2", quantization="w4a8", quantization_group_size=128)
    with pytest.raises(ValueError, match="one of"):
        cbgen.load_model("smollm2", quantization="int4", quantization_group_size=48)
    # 128 does not divide SmolLM2's 576 columns: refused, not left unquantized
    with pytest.raises(ValueError, match="does not divide the 576 input columns"):
        cbgen.load_model("smollm2", quantization="int4", quantization_group_size=128)
    parser = argparse.ArgumentParser()
    add_precision_arguments(parser)
    args = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "128"])
    assert args.quantization_group_size == 128
    assert parser.parse_args([]).quantization_group_size == 32


def test_a_quantized_load_keeps_only_its_embedding_in_the_weights_file(tmp_path):
    """The tensors quantization leaves (norms, biases) must not keep the safetensors file
    mapped: every page it read would stay in the resident set (2.5 GB on a 1B model).
    Only the input embedding stays a view of the file, with its pages dropped, for the
    fast decoder to read the rows it uses (``tests/test_embedding_rows.py``)."""
    import gc

    from cbgen import load_model

    model = make_tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    weights = str((tmp_path / "model.safetensors").resolve())

    def in_file(tensor: torch.Tensor) -> bool:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            spans = [line.split()[0].split("-") for line in maps if line.rstrip().endswith(weights)]
        return any(int(a, 16) <= tensor.data_ptr() < int(b, 16) for a, b in spans)

    def viewing_the_file(model: nn.Module) -> set[str]:
        named = [*model.named_parameters(), *model.named_buffers()]
        return {name for name, tensor in named if tensor is not None and in_file(tensor)}

    plain, _ = load_model(str(tmp_path), dtype=torch.bfloat16, tokenizer=False)
    assert len(viewing_the_file(plain)) > 3  # the unquantized load's are views (the check works)
    del plain
    gc.collect()
    quantized, _ = load_model(str(tmp_path), quantization="int4", tokenizer=False)
    gc.collect()
    assert viewing_the_file(quantized) == {"model.embed_tokens.weight"}
    assert isinstance(quantized.model.layers[0].mlp.down_proj, QuantizedLinear)


@needs_kernel
def test_w4a8_runs_the_vnni_kernel_on_int8_activations():
    """w4a8 keeps int4's codes and runs cbgen's VNNI kernel where the CPU has it: its
    output is the product with activations quantized to int8 per group of 32 (to float32
    rounding), not int4's bfloat16-activation product, and int4 never takes that kernel."""
    torch.manual_seed(3)
    linear = nn.Linear(96, 48, bias=True)
    w4a8 = QuantizedLinear.from_linear(linear, "w4a8")
    int4 = QuantizedLinear.from_linear(linear, "int4")
    assert torch.equal(w4a8.unpacked()[0], int4.unpacked()[0]) and int4.kernel().path != "vnni"
    if not decode_kernel().int4_vnni_available():
        pytest.skip("this CPU has no AVX512-VNNI: w4a8 runs the int4 kernel")
    assert w4a8.kernel().path == "vnni"
    x = torch.randn(5, 96)
    x[0] = 0.0  # a row of zeros: a zero scale, no division by it
    x[2, 32:64] = 1e-39  # a group of denormals: its inverse scale would overflow
    x[1, :32] *= 50  # an outlier group
    with torch.inference_mode():
        got = w4a8(x.to(torch.bfloat16)).float()
        plain = int4(x.to(torch.bfloat16)).float()
    want = _reference(w4a8, x)
    assert _relative_error(got, want) < 2**-7  # the output's and the bias add's bf16 roundings
    assert torch.allclose(got[0], linear.bias.to(torch.bfloat16).float())
    assert _relative_error(plain, want) > _relative_error(got, want)


def _random_4bit_inputs(
    rows: int, blocks: int, groups: int, group: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Random codes (uint8), positive scales and negative minima for ``16 * blocks``
    outputs and ``groups`` scale groups of ``group`` columns, and float32 rows with an
    outlier first group of 32 and a zero first row: (x, codes, scales, minima)."""
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = 16 * blocks, group * groups
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    codes = codes.to(torch.uint8)
    scales = torch.rand(out_features, groups, generator=generator) * 0.1 + 1e-3
    minima = -8 * scales * torch.rand(out_features, groups, generator=generator) * 2
    x = torch.randn(rows, in_features, generator=generator)
    x[:, :32] *= 100  # an outlier
    x[0] = 0.0
    return x, codes, scales, minima


def _random_4bit_case(
    rows: int, blocks: int, groups: int, group: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """``_random_4bit_inputs`` with the rows in bfloat16 and the codes packed by
    ``int4_bf16_pack``. Returns (x, packed, scales_minima, the bfloat16 scales and minima
    as float64 [n, groups, 1], the float64 weight)."""
    x, codes, scales, minima = _random_4bit_inputs(rows, blocks, groups, group, seed)
    out_features = codes.shape[0]
    x = x.to(torch.bfloat16)
    packed, scales_minima = decode_kernel().int4_bf16_pack(codes, scales, minima)
    s, m = (t.to(torch.bfloat16).double()[..., None] for t in (scales, minima))
    weight = (codes.double().view(out_features, groups, group) * s + m).view(out_features, -1)
    return x, packed, scales_minima, s, m, weight


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 11),
    blocks=st.integers(1, 5),
    groups=st.integers(1, 5),
    group=st.sampled_from([32, 64, 128, 256]),
    seed=st.integers(0, 2**16),
)
def test_int4_bf16_kernel_is_the_dequantized_product(rows, blocks, groups, group, seed):
    """int4's own kernel (codes as the bfloat16 2 + c / 64, ``vdpbf16ps``, the 2 and the
    1/64 taken back out with each scale group's activation sum) against the float64
    product of the bfloat16 input and the weight its bfloat16 scales and minima stand
    for: within the output's one bfloat16 rounding plus float32 sums of terms up to 128
    times the codes'. Scale groups of 32 to 256 columns, row counts past 4 (the kernel's
    row tile), outlier and all-zero groups, negative minima."""
    if not decode_kernel().int4_bf16_available():
        pytest.skip("built without AVX512-BF16: int4 runs torch's kernel")
    x, packed, scales_minima, s, m, weight = _random_4bit_case(rows, blocks, groups, group, seed)
    got = decode_kernel().int4_bf16_matmul(x, packed, scales_minima).double()
    want = x.double() @ weight.t()
    # The float32 sums add terms up to |x| (2 + code / 64) 64 scale and |x| |minimum|.
    per_column = (128 + 16) * s + m.abs()
    terms = x.double().abs() @ per_column.expand(-1, -1, group).reshape(16 * blocks, -1).t()
    bound = 2**-8 * want.abs() + 2**-20 * terms
    assert bool(((got - want).abs() <= bound).all())
    assert bool((got[0] == 0).all())


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 7),
    blocks=st.integers(1, 4),
    groups=st.integers(1, 4),
    group=st.sampled_from([32, 64, 128, 256]),
    seed=st.integers(0, 2**16),
)
def test_int4_avx2_kernel_is_the_dequantized_product(rows, blocks, groups, group, seed):
    """int4 on AVX2 (``vpmaddwd`` on int16 activations, int4_bf16_pack's layout) against
    the float64 product: within the output's bfloat16 rounding, float32 sums, and each
    activation's int16 rounding (half a step, the group's largest magnitude over 32767)
    times its weights. Odd row counts (the kernel takes rows in pairs), outlier and
    all-zero groups, negative minima."""
    if not decode_kernel().int4_avx2_available():
        pytest.skip("not an AVX2-only build: int4 runs int4_bf16_matmul or torch's kernel")
    x, packed, scales_minima, _, _, weight = _random_4bit_case(rows, blocks, groups, group, seed)
    got = decode_kernel().int4_avx2_matmul(x, packed, scales_minima).double()
    xd = x.double()
    want = xd @ weight.t()
    step = xd.view(rows, groups, group).abs().amax(-1, keepdim=True) / 32767
    rounding = (step / 2).expand(-1, -1, group).reshape(rows, -1) @ weight.abs().t()
    magnitude = xd.abs() @ weight.abs().t()
    bound = 2**-8 * want.abs() + 2**-20 * magnitude + 1.01 * rounding
    assert bool(((got - want).abs() <= bound).all())
    assert bool((got[0] == 0).all())


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    blocks=st.integers(1, 3),
    groups=st.integers(1, 3),
    group=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**16),
)
def test_int4_avx2_grouped_gives_each_span_the_bits_of_its_own_call(
    counts, blocks, groups, group, seed
):
    """``int4_avx2_grouped`` (an MoE layer's experts in one call): each span of rows gets
    exactly what ``int4_avx2_matmul`` gives it against that span's weights; mismatched
    counts or weights are refused."""
    native = decode_kernel()
    if not native.int4_avx2_available():
        pytest.skip("not an AVX2-only build: int4 runs int4_bf16_matmul or torch's kernel")
    total = sum(counts)
    x = _random_4bit_case(max(total, 1), blocks, groups, group, seed)[0][:total]
    cases = [_random_4bit_case(1, blocks, groups, group, seed + 1 + i) for i in range(len(counts))]
    packed, scales = [c[1] for c in cases], [c[2] for c in cases]
    got = native.int4_avx2_grouped(x, counts, packed, scales)
    start = 0
    for count, p, sm in zip(counts, packed, scales, strict=True):
        if count:
            want = native.int4_avx2_matmul(x[start : start + count], p, sm)
            assert torch.equal(got[start : start + count], want)
        start += count
    assert torch.equal(native.int4_grouped(x, counts, packed, scales, "avx2"), got)
    with pytest.raises(RuntimeError, match="add up"):
        native.int4_avx2_grouped(x, [c + 1 for c in counts], packed, scales)
    if blocks > 1:
        other = _random_4bit_case(1, blocks - 1, groups, group, seed)
        with pytest.raises(RuntimeError, match="one shape"):
            native.int4_avx2_grouped(x, [total, 0], [packed[0], other[1]], [scales[0], other[2]])


@needs_kernel
@pytest.mark.parametrize("path", ["vnni", "bf16"])
def test_int4_grouped_runs_each_span_on_the_paths_own_kernel(path):
    """``int4_grouped`` on the kernels without a grouped kernel of their own (w4a8's
    ``int4_vnni_matmul``; ``int4_bf16_matmul`` on AVX512-BF16): each span's rows get
    what a call of that kernel gives them; an unknown path is refused."""
    native = decode_kernel()
    available = native.int4_vnni_available() if path == "vnni" else native.int4_bf16_available()
    if not available:
        pytest.skip(f"this build has no {path} 4-bit kernel")
    pack = native.int4_vnni_pack if path == "vnni" else native.int4_bf16_pack
    matmul = native.int4_vnni_matmul if path == "vnni" else native.int4_bf16_matmul
    counts = [3, 0, 1, 5]
    x = _random_4bit_inputs(sum(counts), 2, 2, 32, seed=11)[0].to(torch.bfloat16)
    weights = [pack(*_random_4bit_inputs(1, 2, 2, 32, seed=12 + i)[1:]) for i in range(4)]
    packed, scales = [w[0] for w in weights], [w[1] for w in weights]
    got = native.int4_grouped(x, counts, packed, scales, path)
    start = 0
    for count, p, sm in zip(counts, packed, scales, strict=True):
        if count:
            assert torch.equal(got[start : start + count], matmul(x[start : start + count], p, sm))
        start += count
    with pytest.raises(RuntimeError, match="no kernel path"):
        native.int4_grouped(x, counts, packed, scales, "torch")


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(5, 7),
    blocks=st.integers(1, 4),
    groups=st.integers(1, 4),
    group=st.sampled_from([32, 64, 128, 256]),
    seed=st.integers(0, 2**16),
)
def test_int4_avx2_kernel_gives_a_row_alone_the_bits_it_gets_in_a_batch(
    batch, blocks, groups, group, seed
):
    """int4's AVX2 kernel takes rows four at a time (the last one to three of a batch
    together) with exact int32 sums and the same float arithmetic per row, so a row's
    output does not depend on the rows beside it, to the bit: at the sums' limits too
    (every code 15 against activations of +-32767)."""
    kernel = decode_kernel()
    if not kernel.int4_avx2_available():
        pytest.skip("int4's AVX2 kernel is not built here")
    x, codes, scales, minima = _random_4bit_inputs(batch, blocks, groups, group, seed)
    codes[:16] = 15
    x[1], x[2] = 1.0, -1.0  # every int16 activation at +-32767
    x = x.to(torch.bfloat16)
    packed, scales_minima = kernel.int4_bf16_pack(codes, scales, minima)
    batched = kernel.int4_avx2_matmul(x, packed, scales_minima)
    for row in range(x.shape[0]):
        alone = kernel.int4_avx2_matmul(x[row : row + 1].contiguous(), packed, scales_minima)
        assert torch.equal(alone[0].view(torch.int16), batched[row].view(torch.int16))


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 7),
    blocks=st.integers(1, 4),
    groups=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_w4a8_kernel_is_the_product_with_int8_activations(rows, blocks, groups, seed):
    """w4a8's kernel (AVX512-VNNI's ``vpdpbusd``, or on AVX2 ``vpmaddubsw`` with int16
    sums of a group's eight pair sums) against the float64 product of the weight and the
    activations as the kernel quantizes them: int8 per group of 32, the step the group's
    largest magnitude over 127 in float32, and the minima against the exact group sums.
    The integer dot products are exact, so what is left is the output's bfloat16
    rounding and float32 sums. Largest codes against largest activations (the int16
    sums' worst case), odd row counts, outlier and all-zero groups."""
    kernel = decode_kernel()
    if not kernel.int4_vnni_available():
        pytest.skip("built with neither AVX512-VNNI nor AVX2: w4a8 runs the int4 kernel")
    x, codes, scales, minima = _random_4bit_inputs(rows, blocks, groups, 32, seed)
    out_features = codes.shape[0]
    codes[0] = 15  # with the largest activations below: 8 pair sums of 2 * 15 * 127
    x[-1, 32:] = 1.0  # every activation of a group at its largest code, 127
    x[0] = 0.0
    x = x.to(torch.bfloat16)
    packed, scales_minima = kernel.int4_vnni_pack(codes, scales, minima)
    got = kernel.int4_vnni_matmul(x, packed, scales_minima).double()
    xf = x.float().view(rows, groups, 32)
    step = xf.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step >= torch.finfo(torch.float32).tiny, 1 / step, 0.0)
    xq = torch.round(xf * inverse)  # half to even, as the kernel's nearbyint
    s, m = (t.to(torch.bfloat16).double() for t in (scales, minima))
    dots = torch.einsum("rgk,ngk->rng", xq.double(), codes.double().view(out_features, groups, 32))
    sums = xf.double().sum(-1)  # [rows, groups]
    want = (dots * s * step.double()[:, None, :, 0]).sum(-1) + sums @ m.t()
    magnitude = (dots.abs() * s * step.double()[:, None, :, 0]).sum(-1) + sums.abs() @ m.abs().t()
    bound = 2**-8 * want.abs() + 2**-20 * magnitude
    assert bool(((got - want).abs() <= bound).all())
    assert bool((got[0] == 0).all())


@needs_kernel
@pytest.mark.parametrize("group", [64, 128])
def test_int4_maps_take_cbgens_kernel_at_larger_groups(group):
    """A map quantized per group of 64 or 128 columns runs int4's own kernel where it is
    built (torch's elsewhere) and gives torch's kernel's product to bfloat16 rounding;
    the packs refuse scales that do not span whole groups of 32, and w4a8's any group
    but 32."""
    kernel = decode_kernel()
    native = (
        "bf16" if kernel.int4_bf16_available() else "avx2" if kernel.int4_avx2_available() else None
    )
    torch.manual_seed(5)
    linear = nn.Linear(256, 48, bias=True)
    module = QuantizedLinear.from_linear(linear, "int4", group)
    assert module.kernel().path == (native or "torch") and module.group_size == group
    codes, scales, minima = quantize_int4(linear.weight, group)
    torch_map = Int4Map(codes, scales, minima, group, linear.bias, use_native_kernels=False)
    assert torch_map.path == "torch"
    x = torch.randn(6, 256).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = module(x).float(), torch_map(x).float()
    assert _relative_error(got, want) < 2**-6
    assert _relative_error(got, _reference(module, x.float())) < 2**-6
    with pytest.raises(RuntimeError, match="group"):
        three = torch.rand(48, 3)  # 256 columns in 3 scale groups: not whole groups of 32
        kernel.int4_bf16_pack(codes, three, three)
    with pytest.raises(RuntimeError, match="groups of 32"):
        kernel.int4_vnni_pack(codes, scales, minima)


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 11),
    out_features=st.integers(1, 150),
    in_features=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_int8_rows_kernel_is_the_exact_product_to_float32_rounding(
    rows, out_features, in_features, seed
):
    """cbgen's int8 kernel on any shape (tails of both dimensions, of its tasks of 64
    output rows, of its pairs of output rows and its 4 activation rows included): the
    codes times the input rounded to int16 per group of 256 columns (a step of the
    group's largest magnitude over 32767), summed exactly per group, then in float32,
    times each row's scale, rounded once to bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    codes = codes.to(torch.int8)
    scales = (torch.rand(out_features, generator=generator) + 0.01).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator)
    x[:, : in_features // 3] *= 100  # outlier columns: other groups keep their own step
    x = x.to(torch.bfloat16)
    got = decode_kernel().int8_rows_matmul(x, codes, scales).double()
    want = torch.zeros(rows, out_features, dtype=torch.float64)
    magnitude = torch.zeros_like(want)
    for begin in range(0, in_features, 256):
        group = x[:, begin : begin + 256].float()
        step = group.abs().amax(dim=1, keepdim=True) / 32767
        inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
        quantized = torch.round(group * inverse).double()
        assert bool((quantized.abs() <= 32767).all())
        group_codes = codes[:, begin : begin + 256].double().t()
        want += quantized @ group_codes * step.double()
        # The kernel's float32 sums add its lanes' partial sums, each up to the sum of
        # |products| of its columns, so cancellation there costs float32 steps of that.
        magnitude += quantized.abs() @ group_codes.abs() * step.double()
    want *= scales.double()
    magnitude *= scales.double()
    # Exact integer sums per lane and group, float32 sums of those, then one bfloat16
    # rounding of the output.
    assert bool(((got - want).abs() <= 2**-8 * want.abs() + 2**-20 * magnitude).all())
    # The int16 step is far below the input's own bfloat16 rounding.
    exact = (x.double() @ codes.double().t()) * scales.double()
    assert float((got - exact).abs().max()) <= 2**-7 * float(exact.abs().max()) + 1e-6
    # Each row's output is the same bits however many rows come with it: a sequence's
    # logits do not depend on the batch it decodes in.
    for row in range(rows):
        alone = decode_kernel().int8_rows_matmul(x[row : row + 1], codes, scales).double()
        assert torch.equal(alone[0], got[row])


@needs_kernel
def test_int8_maps_take_cbgens_kernel_at_every_row_count():
    """cbgen's int8 kernel serves every row count (torch's only where it was built without
    AVX512-VNNI); it gives the dequantized product to the output's rounding."""
    torch.manual_seed(4)
    linear = nn.Linear(64, 48, bias=False)
    module = QuantizedLinear.from_linear(linear, "int8")
    kernel = module.kernel()
    with torch.inference_mode():  # an empty batch goes to torch, not the row kernel
        assert module(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 48)
    if kernel.rows_limit == 0:
        pytest.skip("built without AVX512-VNNI: every row count runs torch's kernel")
    assert kernel.rows_limit >= 4096
    for rows in (1, 4, 5, 16, 300):
        x = torch.randn(rows, 64)
        rounded = x.to(torch.bfloat16)
        with torch.inference_mode():
            got = module(rounded)
        assert _relative_error(got, _reference(module, x)) < KERNEL_RTOL
        want = decode_kernel().int8_rows_matmul(rounded, module.codes, kernel.scales)
        assert torch.equal(got, want)


def test_w4a8_wants_groups_of_32():
    with pytest.raises(ValueError, match="groups? of 32"):
        quantize_model(make_tiny_model("llama"), "w4a8", group_size=64)
    with pytest.raises(ValueError, match="one of"):
        quantize_model(make_tiny_model("llama"), "w4a16")


@pytest.mark.parametrize("chunk", [1, 7 * 48, 1 << 24])  # a row, uneven chunks, whole
def test_quantizers_give_the_same_codes_a_chunk_of_rows_at_a_time(monkeypatch, chunk):
    """Quantizing a few rows at a time (to bound the float32 temporaries) changes no bit:
    the formulas are per row (int8) and per group (int4)."""
    from cbgen.executor.cpu import quantization

    torch.manual_seed(5)
    weight = (torch.randn(100, 96) * torch.rand(100, 1) * 3).to(torch.bfloat16)
    monkeypatch.setattr(quantization, "QUANTIZE_CHUNK_ELEMENTS", chunk)
    # The torch path (the native quantizers take whole rows, no chunks; compared with
    # this path bit for bit below).
    monkeypatch.setattr(quantization, "_native_quantizer", lambda weight: None)
    codes, scales = quantization.quantize_int8(weight)
    w = weight.float()
    want_scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, torch.round(w / want_scales[:, None]).clamp(-127, 127).to(torch.int8))
    codes4, scales4, minima = quantization.quantize_int4(weight, 32)
    g = w.view(100, 3, 32)
    low = g.amin(dim=-1)
    step = ((g.amax(dim=-1) - low) / 15.0).clamp(min=1e-10)
    want4 = torch.round((g - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    assert torch.equal(minima, low) and torch.equal(scales4, step)
    assert torch.equal(codes4, want4.view(100, 96))


def _torch_quantizers(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """The torch path's int4 (packed) and int8 results, the native quantizers set aside."""
    from cbgen.executor.cpu import quantization

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantization, "_native_quantizer", lambda weight: None)
        return (*quantization.quantize_int4_packed(weight, group), *quantize_int8(weight))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 4),
    group=st.sampled_from([32, 64, 128, 256]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_native_quantizers_give_the_torch_paths_codes_to_the_bit(
    rows, groups, group, dtype, magnitude, seed
):
    """``kernels/quantize.cpp`` (one pass a row at load time) against the torch path, the
    fallback without native kernels: the same packed codes, scales and minima to the bit
    in every weight dtype, group size and magnitude, with a constant group (the scale's
    floor), a group of exact ties (round half to even), and rows of mixed scales."""
    from cbgen.executor.cpu import quantization

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, groups * group, generator=generator) * magnitude
    weight *= torch.rand(rows, 1, generator=generator) * 3
    weight[0, :group] = 0.25 * magnitude  # constant: scale 1e-10, every code 0
    if rows > 1:  # 0, 0.5, ..., 15: a scale of exactly 1 and a tie at every odd step
        weight[1, :group] = (torch.arange(group) % 31) / 2
    weight = weight.to(dtype)
    native = quantization.quantize_int4_packed(weight, group) + quantize_int8(weight)
    for got, want in zip(native, _torch_quantizers(weight, group), strict=True):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


@needs_kernel
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_that_is_not_finite_is_refused(monkeypatch, native, bad):
    """NaN or infinity has no code: both quantizer paths refuse it, naming the row, and
    quantize_model passes the refusal on (the torch path's old answer was an undefined
    cast into the codes)."""
    from cbgen.executor.cpu import quantization

    if not native:
        monkeypatch.setattr(quantization, "_native_quantizer", lambda weight: None)
    weight = torch.randn(48, 64)
    weight[37, 5] = bad
    for quantize in (quantize_int8, quantize_int4):
        with pytest.raises(ValueError, match="row 37 .* not finite"):
            quantize(weight)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    with pytest.raises(ValueError, match="not finite"):
        quantize_model(model, "int4")


@needs_kernel
@pytest.mark.parametrize("packer", ["int4_bf16_pack", "int4_vnni_pack"])
def test_packers_take_codes_two_a_byte(packer):
    """The engine packs a map's codes as QuantizedLinear keeps them (two a byte) without
    widening them first: the same layout as from one code a byte."""
    generator = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (48, 128), generator=generator).to(torch.uint8)
    scales, minima = torch.rand(48, 4, generator=generator), -torch.rand(48, 4, generator=generator)
    pack = getattr(decode_kernel(), packer)
    two_a_byte = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    for got, want in zip(
        pack(two_a_byte, scales, minima, nibbles=True), pack(codes, scales, minima), strict=True
    ):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError):  # half the columns: the scales no longer fit
        pack(two_a_byte, scales, minima)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_quantizing_a_file_backed_model_hands_its_weight_pages_back(tmp_path):
    """Weights loaded from safetensors are views of the mapped file: once a map is
    quantized its pages leave the resident set, so a whole file is never resident beside
    the codes (a 1B model's load peaked at 4.3 GB with them, 2.0 GB without)."""
    weight = torch.randn(4096, 4096)  # 64 MiB
    mapped = file_mapped(tmp_path, weight)
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False))
    model[0].weight = nn.Parameter(mapped, requires_grad=False)
    assert float(mapped.sum()) == float(weight.sum())  # every page is resident now
    before = _file_resident_bytes()
    assert quantize_model(model, "int8") == 1
    assert before - _file_resident_bytes() > 48 * 2**20
    assert torch.equal(model[0].codes, quantize_int8(weight)[0])
    assert float(mapped.sum()) == float(weight.sum())  # mapped again from the page cache


def _file_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile line")
