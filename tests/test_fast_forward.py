"""The decoder fast path (``cbgen.executor.cpu.fast_forward``): when it is taken, and that it computes
what the model's own forward computes."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    fast_path_errors,
    fast_path_steps,
    make_tiny_model,
    random_prompts,
    run_until_done,
)

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.cpu.fast_forward import DISABLE_ENV, _norm_heads
from cbgen.executor.cpu.kernels import decode_kernel

pytestmark = pytest.mark.skipif(decode_kernel() is None, reason="native kernels not built")

FAST = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mistral-sliding",
    "phi3",
    "phi3-partial",
    "gemma",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
]
NOT_FAST = ["granite", "gpt2", "phimoe"]


@pytest.mark.parametrize("arch", FAST + NOT_FAST)
def test_taken_exactly_for_llama_family_layers(arch):
    with EngineCore(make_tiny_model(arch)) as engine:
        assert (engine.executor.runner.fast_forward is not None) == (arch in FAST)


@pytest.mark.parametrize("arch", FAST)
def test_step_logits_match_the_model_forward(arch):
    """Every step of a run with chunked prefill, decodes and a mixed batch: the fast
    path's logits against the model's own forward on the same batch."""
    steps = fast_path_steps(make_tiny_model(arch), random_prompts(5, 3, 30, seed=1))
    for logits, reference, _ in steps:
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    compared = [decode_only for _, _, decode_only in steps]
    assert True in compared and False in compared  # decode-only and mixed steps both ran


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3", "qwen2_moe", "olmoe"])
def test_bfloat16_step_logits_are_close_to_the_bfloat16_model_forward(arch):
    """In bfloat16 the fast path keeps the residual stream and norms in float32, so it is
    not bitwise transformers' bfloat16 forward: every step's logits within 5% (relative
    norm of the difference) of the model's own bfloat16 forward on the same batch."""
    model = make_tiny_model(arch).to(torch.bfloat16)
    errors = fast_path_errors(model, random_prompts(5, 3, 30, seed=1))
    assert errors and max(errors) < 0.05, errors


@pytest.mark.parametrize("parts", [1, 4])
def test_bfloat16_qk_norms_are_the_modules_formula_rounded_once(parts):
    """In bfloat16 the q/k norms (Qwen3's over each head, OLMoE's over all of q) are one
    ``add_rms_norm`` call on the fused q/k/v output, in place: ``weight * (x / rms(x))``
    in float32, rounded once, as the torch formula computes it (within one bfloat16
    rounding: the variance is summed in another order), and the rest of the row kept."""
    generator = torch.Generator().manual_seed(0)
    qkv = (3 * torch.randn(5, 96, generator=generator)).to(torch.bfloat16)
    weight = torch.rand(64 // parts, generator=generator).to(torch.bfloat16) + 0.5
    before = qkv.clone()
    q = qkv[:, :64].view(5, parts, -1)
    wide = q.float()
    want = weight.float() * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6))
    _norm_heads(q, weight, 1e-6, decode_kernel())
    torch.testing.assert_close(q.float(), want, rtol=2**-7, atol=0)
    assert not torch.equal(qkv[:, :64], before[:, :64])
    assert torch.equal(qkv[:, 64:], before[:, 64:])


def test_outputs_equal_with_and_without_the_fast_path(monkeypatch):
    model = make_tiny_model("qwen2", seed=3)
    prompts = random_prompts(12, 1, 40, seed=2)
    config = EngineConfig(max_batch_tokens=32, block_size=4, num_blocks=24)  # preempts

    def run() -> tuple[list[list[int]], bool]:
        with EngineCore(model, config) as engine:
            for prompt in prompts:
                engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
            results = run_until_done(engine)
            assert engine.stats["preemptions"] > 0
            return [
                r.token_ids for r in results.values()
            ], engine.executor.runner.fast_forward is not None

    fast_tokens, fast_on = run()
    monkeypatch.setenv(DISABLE_ENV, "1")
    module_tokens, module_on = run()
    assert fast_on and not module_on
    assert fast_tokens == module_tokens


def test_a_forward_hook_keeps_the_model_forward(llama):
    calls = []
    handle = llama.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        with EngineCore(llama) as engine:
            assert engine.executor.runner.fast_forward is None
            engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
            run_until_done(engine)
    finally:
        handle.remove()
    assert len(calls) >= 2  # the probe, then every step


def test_close_drops_the_fast_path(llama):
    engine = EngineCore(llama)
    assert engine.executor.runner.fast_forward is not None
    engine.close()
    assert engine.executor.runner.fast_forward is None
