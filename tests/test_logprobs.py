"""Logprobs of generated and prompt tokens equal a plain forward's ``log_softmax``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_model, random_prompts, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams

TOLERANCE = 1e-4  # float32 logprobs, cbgen's paged attention against the model's own


def _forward_logprobs(model, token_ids):
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_forward(model, prompt, out, top):
    reference = _forward_logprobs(model, prompt + out.token_ids)
    n = len(prompt)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[n + i - 1]
        assert token in entry and len(entry) in (top, top + 1)
        assert abs(entry[token] - row[token].item()) < TOLERANCE
        best = row.topk(top)
        assert list(entry)[:top] == best.indices.tolist()
        for tid, value in entry.items():
            assert abs(value - row[tid].item()) < TOLERANCE
    if out.prompt_logprobs is not None:
        assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
        for pos in range(1, n):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[prompt[pos]] - reference[pos - 1, prompt[pos]].item()) < TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mistral-sliding", "gpt2"])
def test_logprobs_equal_forward_log_softmax(arch):
    model = make_tiny_model(arch)
    prompts = random_prompts(4, 2, 40, seed=3)
    config = EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=16)  # chunked
    params = SamplingParams(max_new_tokens=10, logprobs=3, prompt_logprobs=2)
    outputs = cbgen.generate_batch(model, prompts, params, config)
    for prompt, out in zip(prompts, outputs, strict=True):
        _check_against_forward(model, prompt, out, top=3)
    plain = cbgen.generate_batch(model, prompts, SamplingParams(max_new_tokens=10), config)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)


def test_sampled_token_logprob_is_always_reported(llama):
    prompts = random_prompts(6, 3, 10, seed=4)
    params = SamplingParams(max_new_tokens=12, temperature=1.5, seed=1, logprobs=0)
    for prompt, out in zip(prompts, cbgen.generate_batch(llama, prompts, params), strict=True):
        reference = _forward_logprobs(llama, prompt + out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert list(entry) == [token]  # logprobs=0: the sampled token alone
            assert abs(entry[token] - reference[len(prompt) + i - 1, token].item()) < TOLERANCE


def test_logprobs_are_raw_before_penalties_and_temperature(llama):
    prompt = random_prompts(1, 8, 8, seed=5)[0]
    params = SamplingParams(
        max_new_tokens=6, logprobs=1, repetition_penalty=2.0, logit_bias={7: 3.0}
    )
    (out,) = cbgen.generate_batch(llama, [prompt], params)
    _check_against_forward(llama, prompt, out, top=1)


def test_prompt_logprobs_survive_prefix_caching_preemption_and_async():
    model = make_tiny_model("llama")
    shared = random_prompts(1, 24, 24, seed=6)[0]
    prompts = [shared + tail for tail in random_prompts(6, 4, 20, seed=7)]
    params = SamplingParams(max_new_tokens=24, logprobs=2, prompt_logprobs=1)
    for config in (
        EngineConfig(block_size=4, num_blocks=26, max_batch_tokens=16),  # preempts
        EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=32, async_scheduling=True),
    ):
        with EngineCore(model, config) as engine:
            warm = engine.add_request(shared, SamplingParams(max_new_tokens=2))
            run_until_done(engine)
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, params, request_id=str(i))
            results = run_until_done(engine)
            assert warm and engine.allocator.num_free == config.num_blocks
        for i, prompt in enumerate(prompts):
            out = results[str(i)]
            assert out.num_cached_tokens == 0  # scored prompts are computed
            _check_against_forward(model, prompt, out, top=2)


def test_echo_only_prompt_logprobs_with_one_token(llama):
    prompt = random_prompts(1, 12, 12, seed=8)[0]
    (out,) = cbgen.generate_batch(
        llama, [prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    )
    reference = _forward_logprobs(llama, prompt)
    assert out.logprobs is None
    total = sum(entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True))
    want = sum(reference[i - 1, prompt[i]].item() for i in range(1, len(prompt)))
    assert math.isclose(total, want, abs_tol=len(prompt) * TOLERANCE)


def test_stream_deltas_carry_new_logprobs(llama):
    prompt = random_prompts(1, 6, 6, seed=9)[0]
    with EngineCore(llama, EngineConfig(block_size=4, num_blocks=64)) as engine:
        engine.add_request(prompt, SamplingParams(max_new_tokens=5, logprobs=1), "a")
        streamed, last = [], None
        while engine.has_unfinished():
            for out in engine.step():
                streamed += out.new_logprobs
                assert len(out.new_logprobs) == len(out.new_token_ids)
                last = out
    assert streamed == last.logprobs and len(streamed) == 5
