"""Quantized MoE experts (``cbgen.executor.cpu.quantized_experts``): what they compute, which
experts modules they take, and weight updates by transformers' names."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from architectures import build_config
from conftest import fast_path_errors, random_prompts
from transformers import AutoModelForCausalLM

from cbgen import EngineCore, SamplingParams, generate_batch
from cbgen.core.weights import load_named_weights
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.model_quantization import quantize_model
from cbgen.executor.cpu.prepack import onednn_packs
from cbgen.executor.cpu.quantization import QuantizedLinear, dequantize
from cbgen.executor.cpu.quantized_experts import QuantizedExperts, quantizing_experts_as_loaded
from cbgen.executor.cpu.routed_experts import experts_parameters, per_expert, route_tokens

# transformers 5's experts modules (3D gate_up_proj / down_proj) with the default gate.
ROUTED = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "granitemoe",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "phimoe",
    "deepseek_v3",
]


def _model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()
    return model.to(dtype)


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if experts_parameters(module) is not None
    }


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1)
    return index, weights


def _dequantized_source(source: torch.nn.Module, quantized: QuantizedExperts) -> torch.nn.Module:
    """``source`` holding the float weights ``quantized``'s codes stand for."""
    reference = copy.deepcopy(source)
    with torch.no_grad():
        for name, maps in (
            (quantized.first_name, quantized.first_maps),
            ("down_proj", quantized.down_proj),
        ):
            weight = getattr(reference, name)
            for e, module in enumerate(maps):
                weight[e] = dequantize(module).to(weight.dtype)
    return reference


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("arch", ROUTED)
def test_quantized_experts_compute_the_module_with_the_dequantized_weights(arch, mode):
    """Each layer's ``QuantizedExperts`` against the layer's own experts module holding the
    weights its codes stand for: the same routed sum, up to the kernels' bfloat16
    rounding of activations and outputs (2^-8 relative a map)."""
    model = _model(arch)
    sources = {name: copy.deepcopy(m) for name, m in _experts(model).items()}
    quantize_model(model, mode)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    assert quantized and set(quantized) == set(sources)
    for name, module in quantized.items():
        reference = _dequantized_source(sources[name], module)
        x = torch.randn(9, reference.down_proj.shape[1], generator=torch.Generator().manual_seed(1))
        index, weights = _routing(9, module.num_experts, 2, seed=2)
        with torch.no_grad():
            want = reference(x.to(torch.bfloat16).float(), index, weights)
            got = module(x, index, weights)
        error = float((got - want).abs().max() / want.abs().max())
        assert error < 0.03, (name, error)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_quantized_moe_model_generates_its_own_forwards_greedy_tokens(arch):
    """Continuous batching on a model with quantized experts: each greedy token is the
    argmax of the model's own forward over the prompt and the tokens before it, up to 2%
    of the logits' spread. (Not token-identical to ``generate()``: the kernels round
    activations to bfloat16, which turns a float32 difference of one ulp, a GEMM's batch
    size's doing, into a step of 2^-8 now and then.)"""
    model = _model(arch)
    quantize_model(model, "int4")
    assert any(isinstance(m, QuantizedExperts) for m in model.modules())
    prompts = random_prompts(5, 3, 20, seed=3)
    outputs = generate_batch(model, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.token_ids)
        assert len(tokens) == 8
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        top, spread = logits.max(dim=1).values, logits.max(dim=1).values - logits.min(dim=1).values
        assert bool(((top - chosen) <= 0.02 * spread).all()), (top - chosen) / spread


def test_route_tokens_is_transformers_eager_loop():
    """The routing alone, with float maps: the module's own eager forward to float32
    rounding, an index past the last expert (expert parallelism's sentinel) adding
    nothing."""
    model = _model("mixtral")
    source = next(iter(_experts(model).values()))
    source.config._experts_implementation = "eager"
    x = torch.randn(11, source.down_proj.shape[1])
    index, weights = _routing(11, source.num_experts, 2, seed=4)
    gate_up = [lambda r, e=e: r @ source.gate_up_proj[e].t() for e in range(source.num_experts)]
    down = [lambda r, e=e: r @ source.down_proj[e].t() for e in range(source.num_experts)]

    def activate(rows: torch.Tensor) -> torch.Tensor:
        gate, up = rows.chunk(2, dim=-1)
        return source.act_fn(gate) * up

    with torch.no_grad():
        want = source(x, index, weights)
        got = route_tokens(
            x, index, weights, per_expert(gate_up), per_expert(down), activate, source.num_experts
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        sentinel = index.clone()
        sentinel[0, 1] = source.num_experts
        partial = route_tokens(
            x,
            sentinel,
            weights,
            per_expert(gate_up),
            per_expert(down),
            activate,
            source.num_experts,
        )
    only_first = down[index[0, 0]](activate(gate_up[index[0, 0]](x[:1]))) * weights[0, 0]
    torch.testing.assert_close(partial[0], only_first[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(partial[1:], want[1:])


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v4"])
def test_experts_with_a_gate_of_their_own_keep_their_weights_and_say_so(arch, caplog):
    """gpt-oss and DeepSeek-V4 clamp their gates' inputs: refused by name (a check on a
    few small activations would not see the clamp), kept in float, and logged."""
    model = _model(arch)
    before = {name: type(m) for name, m in _experts(model).items()}
    with caplog.at_level(logging.WARNING, logger="cbgen"):
        quantize_model(model, "int4")
    after = {name: type(m) for name, m in _experts(model).items()}
    assert before == after and before
    assert "gates its experts its own way" in caplog.text


def test_experts_that_compute_something_else_are_refused_by_the_check(caplog):
    """An experts module whose forward differs from routed experts (here, one that ignores
    the routing weights) fails the check against its own forward and keeps its weights."""
    model = _model("mixtral")
    for module in _experts(model).values():
        cls = type(module)

        class Unweighted(cls):  # type: ignore[misc, valid-type]
            def forward(self, hidden, index, weights):
                return super().forward(hidden, index, torch.ones_like(weights))

        module.__class__ = Unweighted
    with caplog.at_level(logging.WARNING, logger="cbgen"):
        quantize_model(model, "int4")
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    assert "computes something else than plain routed experts" in caplog.text


def test_weight_updates_by_transformers_names_requantize_each_expert():
    """``load_named_weights`` takes the 3D ``experts.gate_up_proj`` and ``down_proj`` of
    another checkpoint and gives the codes quantizing that checkpoint gives; a 3D weight
    of the wrong shape is refused before anything is written."""
    model, other = _model("olmoe", seed=0), _model("olmoe", seed=1)
    new = {n: t for n, t in other.state_dict().items() if ".experts." in n}
    assert new and all(t.dim() == 3 for t in new.values())
    quantize_model(model, "int4")
    quantize_model(other, "int4")
    assert load_named_weights(model, new) == sum(t.shape[0] for t in new.values())
    got = {n: t for n, t in model.state_dict().items() if ".experts." in n}
    want = {n: t for n, t in other.state_dict().items() if ".experts." in n}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    name = next(iter(new))
    codes = got[f"{name}.0.codes"].clone()
    with pytest.raises(ValueError, match="gives experts of"):
        load_named_weights(model, {name: new[name].transpose(1, 2).contiguous()})
    assert torch.equal(model.state_dict()[f"{name}.0.codes"], codes)


def test_bfloat16_experts_quantize_and_every_expert_map_is_a_quantized_linear():
    model = _model("qwen3_moe", dtype=torch.bfloat16)
    experts = _experts(model)
    quantize_model(model, "w4a8")
    for name in experts:
        module = model.get_submodule(name)
        assert isinstance(module, QuantizedExperts)
        maps = [*module.first_maps, *module.down_proj]
        assert len(maps) == 2 * module.num_experts
        assert all(isinstance(m, QuantizedLinear) and m.mode == "w4a8" for m in maps)


@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe"])
def test_experts_are_quantized_as_transformers_loads_them(arch, tmp_path):
    """Inside ``quantizing_experts_as_loaded`` each experts module is already quantized when
    ``from_pretrained`` returns (the bf16 experts never all in memory at once), with the
    codes quantizing after the load gives; ``load_model`` loads that way."""
    import cbgen

    model = _model(arch)
    model.save_pretrained(tmp_path)
    with quantizing_experts_as_loaded("int4"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    names = set(_experts(model))
    assert names and all(isinstance(loaded.get_submodule(n), QuantizedExperts) for n in names)
    quantize_model(model, "int4")
    via_loader, _ = cbgen.load_model(
        str(tmp_path), dtype=torch.float32, quantization="int4", tokenizer=False
    )
    for name in names:
        want = model.get_submodule(name).state_dict()
        for got in (
            loaded.get_submodule(name).state_dict(),
            via_loader.get_submodule(name).state_dict(),
        ):
            assert got.keys() == want.keys()
            assert [k for k in want if not torch.equal(got[k], want[k])] == []
    quantize_model(loaded, "int4")  # the linear maps
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe"])
def test_quantized_moe_models_take_the_fast_decoder(arch):
    """A bfloat16 MoE model with int4 maps and experts runs the fast decoder (its MoE
    blocks called whole): every step's logits within 5% of the model's own forward."""
    model = _model(arch, dtype=torch.bfloat16)
    quantize_model(model, "int4")
    errors = fast_path_errors(model, random_prompts(4, 3, 20, seed=6), max_new_tokens=5)
    assert errors and max(errors) < 0.05, errors


def test_an_unquantized_load_keeps_the_experts_as_transformers_loads_them(tmp_path):
    """Without quantization the hook only lets the checkpoint's file pages go once a
    layer's experts are stacked: the loaded model is transformers' own, tensor for
    tensor."""
    import cbgen

    model = _model("mixtral")
    model.save_pretrained(tmp_path)
    loaded, _ = cbgen.load_model(str(tmp_path), tokenizer=False)
    assert not any(isinstance(m, QuantizedExperts) for m in loaded.modules())
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(
    decode_kernel() is None or onednn_packs(torch.bfloat16),
    reason="bf16 experts take cbgen's kernels only where oneDNN packs no bfloat16",
)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_experts_run_cbgens_kernels_while_an_engine_holds_the_model(arch):
    """On a CPU whose oneDNN packs no bfloat16 (AVX2), an engine routes a bfloat16 MoE
    model's experts through ``PackedMap`` views of their weights: each layer's output
    within bfloat16 rounding of the experts module's own forward, the module's own
    forward back once the engine is closed, and generation runs through them."""
    model = _model(arch, dtype=torch.bfloat16)
    experts = _experts(model)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    index, weights = _routing(9, 4, 2, seed=8)
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        want = {name: m(x, index, weights).float() for name, m in experts.items()}
    with EngineCore(model) as engine:
        assert engine.executor.runner.fast_forward is not None
        for name, module in experts.items():
            assert "forward" in module.__dict__, name
            with torch.no_grad():
                got = module(x, index, weights).float()
            error = float((got - want[name]).abs().max() / want[name].abs().max())
            assert error < 0.03, (name, error)
    assert not any("forward" in m.__dict__ for m in experts.values())
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = generate_batch(model, random_prompts(4, 3, 20, seed=9), params)
    assert [len(o.token_ids) for o in outputs] == [6] * 4


@pytest.mark.parametrize("mode", ["int4", "w4a8", "int8"])
def test_one_native_call_for_a_layers_experts_gives_the_bits_of_a_call_each(mode):
    """Where a layer's expert maps run on one of cbgen's 4-bit kernels, their spans go to
    the kernel in one call (``int4_grouped``): the same bits as calling each expert's map
    on its own rows; int8 maps take a call each."""
    model = _model("olmoe", dtype=torch.bfloat16)
    quantize_model(model, mode)
    module = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    index, weights = _routing(7, module.num_experts, 2, seed=4)
    weights = weights.to(torch.bfloat16)
    first = per_expert([m.kernel() for m in module.first_maps])
    down = per_expert([m.kernel() for m in module.down_proj])
    with torch.no_grad():
        got = module(x, index, weights)
        want = route_tokens(x, index, weights, first, down, module.activate, module.num_experts)
    assert torch.equal(got, want)
