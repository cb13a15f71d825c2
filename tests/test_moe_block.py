"""MoE blocks in the fast decoder (``cbgen.executor.cpu.moe_block``): 4-bit experts in one
native call (``routed_int4_experts``), what it computes, and which blocks it takes."""

from __future__ import annotations

import pytest
import torch
from architectures import build_config
from conftest import fast_path_errors, random_prompts, run_until_done
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from cbgen import EngineCore, SamplingParams
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.model_quantization import quantize_model
from cbgen.executor.cpu.moe_block import NativeExpertsBlock, moe_call
from cbgen.executor.cpu.quantized_experts import QuantizedExperts

pytestmark = pytest.mark.skipif(
    decode_kernel() is None or not hasattr(decode_kernel(), "routed_int4_experts"),
    reason="needs cbgen's native kernels",
)


def _model(arch: str, mode: str | None = "int4", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()
    model = model.to(torch.bfloat16)
    if mode is not None:
        quantize_model(model, mode)
    return model


def _first_experts(model: torch.nn.Module) -> QuantizedExperts:
    return next(m for m in model.modules() if isinstance(m, QuantizedExperts))


def _reference(
    experts: QuantizedExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each expert's own maps (a kernel call an expert), ``silu_mul``, and the weighted
    rows added in float32 expert by expert, in ascending order."""
    kernels = decode_kernel()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(experts.num_experts):
        tokens, slots = (index == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = experts.first_maps[e].kernel()(x[tokens])
        rows = experts.down_proj[e].kernel()(kernels.silu_mul(gate_up, gate_up.shape[1] // 2))
        out.index_add_(0, tokens, rows.float() * weights[tokens, slots, None].float())
    return out


@pytest.fixture(scope="module", params=["int4", "w4a8"])
def olmoe(request):
    return _model("olmoe", request.param)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tokens=st.integers(1, 12),
    k=st.integers(1, 3),
    sentinels=st.integers(0, 2),
    bf16_weights=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_call_gives_the_bits_of_each_experts_own_maps_summed_in_float32(
    olmoe, tokens, k, sentinels, bf16_weights, seed
):
    """``routed_int4_experts`` sorts the token-expert pairs, runs each expert's maps on its
    rows and adds the weighted rows in ascending expert order: the same bits as the
    experts' own kernels a call each with the sum in float32. A sentinel index (expert
    parallelism's, past the last expert) adds nothing."""
    experts = _first_experts(olmoe)
    count = experts.num_experts
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=generator).to(torch.bfloat16)
    k = min(k, count)
    index = torch.stack([torch.randperm(count, generator=generator)[:k] for _ in range(tokens)])
    for i in range(min(sentinels, tokens)):
        index[i, 0] = count
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1)
    if bf16_weights:
        weights = weights.to(torch.bfloat16)
    got = NativeExpertsBlock(None, experts).experts(x, index, weights)
    assert got.dtype == torch.float32
    assert torch.equal(got, _reference(experts, x, index, weights))


def test_a_negative_expert_index_is_refused(olmoe):
    native = NativeExpertsBlock(None, _first_experts(olmoe))
    x = torch.randn(2, 64).to(torch.bfloat16)
    index = torch.tensor([[0, -1], [1, 2]])
    with pytest.raises(RuntimeError, match="negative expert index"):
        native.experts(x, index, torch.ones(2, 2))


@pytest.mark.parametrize(
    ("arch", "mode", "bound"),
    [
        ("olmoe", "int4", 0.05),
        ("qwen3_moe", "int4", 0.05),
        ("mixtral", "int4", 0.05),
        # w4a8 rounds the activations to int8, which the fast decoder's float32 residual
        # moves: its whole blocks are 8% off the model's own forward on this tiny Mixtral too.
        ("mixtral", "w4a8", 0.1),
    ],
)
def test_the_fast_decoder_runs_4bit_experts_in_one_native_call(arch, mode, bound):
    """Mixtral, Qwen3-MoE and OLMoE blocks with 4-bit experts run as ``NativeExpertsBlock``s
    (the model's router, the experts in one call): every step's logits as close to the
    model's own forward as the whole blocks were."""
    model = _model(arch, mode)
    with EngineCore(model) as engine:
        fast = engine.executor.runner.fast_forward
        assert fast is not None
        assert all(isinstance(layer.moe, NativeExpertsBlock) for layer in fast._layers)
    errors = fast_path_errors(model, random_prompts(4, 3, 20, seed=6), max_new_tokens=5)
    assert errors and max(errors) < bound, errors


def test_a_block_with_a_shared_expert_runs_whole():
    """Qwen2-MoE adds a gated shared expert to the routed ones: not a plain block."""
    model = _model("qwen2_moe")
    block = model.model.layers[0].mlp
    assert not isinstance(moe_call(block), NativeExpertsBlock)


def test_a_block_whose_forward_computes_more_fails_the_check_and_runs_whole():
    """The check runs the block's own forward: one that does more than route (here,
    doubling its output) is called whole, and the whole call gives its output."""
    model = _model("olmoe")
    block = model.model.layers[0].mlp
    assert isinstance(moe_call(block), NativeExpertsBlock)
    original = block.forward
    block.forward = lambda hidden_states: 2 * original(hidden_states)
    call = moe_call(block)
    assert not isinstance(call, NativeExpertsBlock)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(call(x), block(x[None])[0])


def test_unquantized_experts_run_whole():
    model = _model("olmoe", mode=None)
    assert not isinstance(moe_call(model.model.layers[0].mlp), NativeExpertsBlock)


def test_a_weight_update_reaches_the_native_experts():
    """The native block holds the experts' codes as they were when the engine was built;
    ``update_weights`` requantizes the experts and rebuilds the executor, so the next
    tokens are those of an engine built on the updated model."""
    model = _model("olmoe")
    prompts = random_prompts(3, 4, 12, seed=11)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    source = AutoModelForCausalLM.from_config(build_config("olmoe"), dtype=torch.float32)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    update = {name: 3 * torch.randn_like(source.get_parameter(name)).to(torch.bfloat16)}

    def generate(engine: EngineCore) -> list[list[int]]:
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        outputs = run_until_done(engine)
        return [list(outputs[i].token_ids) for i in ids]

    with EngineCore(model) as engine:
        before = generate(engine)
        engine.update_weights(update)
        fast = engine.executor.runner.fast_forward
        assert isinstance(fast._layers[0].moe, NativeExpertsBlock)
        after = generate(engine)
    with EngineCore(model) as fresh:
        want = generate(fresh)
    assert after == want
    assert after != before
