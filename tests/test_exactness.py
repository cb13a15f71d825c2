"""Greedy output must be token-identical to model.generate() in float32."""

from __future__ import annotations

import pytest
import torch
from architectures import MLA_ARCHITECTURES, MOE_ARCHITECTURES, SINK_ARCHITECTURES, build_config
from conftest import (
    ARCHITECTURES,
    chat_prompts,
    make_tiny_model,
    random_prompts,
    reference_greedy,
    run_until_done,
)

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams


def _check(model, prompts, max_new_tokens, config):
    expected = [reference_greedy(model, p, max_new_tokens) for p in prompts]
    outputs = cbgen.generate_batch(
        model, prompts, SamplingParams(max_new_tokens=max_new_tokens), config
    )
    for i, (want, got) in enumerate(zip(expected, outputs, strict=True)):
        assert got.token_ids == want, f"prompt {i} (len {len(prompts[i])}) diverged"
    return outputs


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architectures_match_generate(arch):
    model = make_tiny_model(arch)
    prompts = random_prompts(6, 1, 40, seed=1)
    _check(model, prompts, 24, EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64))
    assert model.config._attn_implementation != "cbgen_paged", "engine must restore attention"


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES + MLA_ARCHITECTURES + SINK_ARCHITECTURES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_moe_mla_and_sink_architectures_match_generate(arch, native):
    """Mixtures of experts, multi-head latent attention (DeepSeek-V2/V3) and attention
    sinks (GPT-OSS, DeepSeek-V4's sliding layers) through the native kernel and the
    torch reference, with prompts chunked beside running decodes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()
    prompts = random_prompts(5, 1, 40, seed=1)
    config = EngineConfig(
        block_size=8, num_blocks=64, max_batch_tokens=24, use_native_kernels=native
    )
    _check(model, prompts, 16, config)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES + MLA_ARCHITECTURES + SINK_ARCHITECTURES)
def test_moe_mla_and_sink_architectures_through_preemption_prefix_cache_and_async(arch):
    """The same families with a shared prefix (the prefix cache hands it over where the
    model allows it), a cache too small for all (preemption), and async scheduling."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()
    shared = random_prompts(1, 24, 24, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 12, seed=6)]
    expected = [reference_greedy(model, p, 16) for p in prompts]
    config = EngineConfig(
        block_size=4, num_blocks=24, max_batch_tokens=32, max_num_seqs=6, async_scheduling=True
    )
    with EngineCore(model, config) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_new_tokens=16), str(i))
        results = run_until_done(engine)
        if not any(group.is_windowed for group in engine.cache_groups):
            # (Windowed layers give back what their window left: those fit; their
            # preemption is tests/test_sliding_window.py's.)
            assert engine.stats["preemptions"] > 0, "the cache was meant to be too small"
        if engine.prefix_caching:
            assert engine.stats["cached_tokens"] > 0
        assert engine.allocator.num_free == engine.allocator.num_blocks
    assert [results[str(i)].token_ids for i in range(len(prompts))] == expected


def test_mixed_batch_with_chunked_prefill(llama):
    # Prompts far longer than the token budget: every one is prefilled in chunks,
    # interleaved with the decodes of the others.
    prompts = random_prompts(8, 1, 120, seed=2)
    prompts.append(random_prompts(1, 150, 150, seed=3)[0])
    _check(llama, prompts, 20, EngineConfig(block_size=4, num_blocks=512, max_batch_tokens=16))


def test_preemption_keeps_outputs_exact(llama):
    # 10 requests of up to ~70 tokens in a cache of 96 tokens: they cannot all fit.
    prompts = random_prompts(10, 10, 40, seed=4)
    config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=32)
    expected = [reference_greedy(llama, p, 30) for p in prompts]
    with EngineCore(llama, config) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=30), request_id=str(i))
        results, preemptions = {}, 0
        while engine.has_unfinished():
            preemptions += sum(r.num_preemptions for r in engine.scheduler.running)
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
        assert engine.allocator.num_free == config.num_blocks
    assert preemptions > 0, "the cache was meant to be too small"
    assert [results[str(i)] for i in range(len(prompts))] == expected


def test_full_length_admission_never_preempts_and_stays_exact(llama):
    # The cache of the test above: eager admission preempts, full-length admission waits.
    prompts = random_prompts(10, 10, 40, seed=4)
    expected = [reference_greedy(llama, p, 30) for p in prompts]
    stats = {}
    for admission in ("eager", "full_length"):
        config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=32, admission=admission)
        with EngineCore(llama, config) as engine:
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=30), request_id=str(i))
            results = run_until_done(engine)
            assert engine.allocator.num_free == config.num_blocks
            stats[admission] = dict(engine.stats)
        assert [results[str(i)].token_ids for i in range(len(prompts))] == expected, admission
    assert stats["eager"]["preemptions"] > 0
    assert stats["full_length"]["preemptions"] == 0


def test_requests_arriving_mid_run(llama):
    prompts = random_prompts(9, 3, 50, seed=5)
    expected = [reference_greedy(llama, p, 25) for p in prompts]
    results = {}
    with EngineCore(
        llama, EngineConfig(block_size=8, num_blocks=256, max_batch_tokens=48)
    ) as engine:
        pending = list(enumerate(prompts))
        steps = 0
        while pending or engine.has_unfinished():
            if pending and steps % 3 == 0:
                i, p = pending.pop(0)
                engine.add_request(p, SamplingParams(max_new_tokens=25), request_id=str(i))
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
            steps += 1
    assert [results[str(i)] for i in range(len(prompts))] == expected


def test_varied_lengths_and_budgets(llama):
    prompts = random_prompts(12, 1, 60, seed=6)
    lengths = [1, 5, 17, 33] * 3
    expected = [reference_greedy(llama, p, n) for p, n in zip(prompts, lengths, strict=True)]
    outputs = cbgen.generate_batch(
        llama,
        prompts,
        [SamplingParams(max_new_tokens=n) for n in lengths],
        EngineConfig(block_size=16, num_blocks=128, max_batch_tokens=40, max_num_seqs=5),
    )
    assert [o.token_ids for o in outputs] == expected


def test_bundled_smollm2_16_chat_prompts(smollm2):
    model, tokenizer = smollm2
    questions = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "Explain photosynthesis in one sentence.",
        "hi",
        "Translate 'good morning' into Spanish.",
        "What is 17 times 23?",
        "Give me three tips for better sleep.",
        "Who wrote Romeo and Juliet?",
        "Summarize the plot of Cinderella in two sentences.",
        "What is a prime number?",
        "Name the planets of the solar system in order from the sun, please, with one fact about each.",
        "Why is the sky blue?",
        "Write a Python function that reverses a string.",
        "What's the difference between weather and climate?",
        "Suggest a name for a pet turtle.",
        "Describe the taste of a lemon to someone who has never had one.",
    ]
    prompts = chat_prompts(tokenizer, questions)
    outputs = _check(model, prompts, 24, EngineConfig(max_batch_tokens=128))
    assert sum(o.finish_reason == "eos" for o in outputs) + sum(
        o.finish_reason == "length" for o in outputs
    ) == len(outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_preemption_keeps_outputs_exact(llama, async_scheduling):
    """Urgent requests arriving mid-run push running ones out; every output stays exact."""
    prompts = random_prompts(5, 6, 20, seed=31)
    expected = [reference_greedy(llama, p, 16) for p in prompts]
    config = EngineConfig(
        num_blocks=64, block_size=8, max_num_seqs=2, async_scheduling=async_scheduling
    )
    with EngineCore(llama, config) as engine:
        for i in range(2):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=16, priority=5), str(i))

        def arrive(step):
            if step == 3:
                for i in range(2, 5):
                    params = SamplingParams(max_new_tokens=16, priority=0)
                    engine.add_request(prompts[i], params, str(i))

        results = run_until_done(engine, after_step=arrive)
        assert engine.stats["preemptions"] >= 1
        assert engine.allocator.num_free == 64
    assert [results[str(i)].token_ids for i in range(5)] == expected
