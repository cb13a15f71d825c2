"""Fused temperature / top-k / top-p sampling and per-request seeds."""

from __future__ import annotations

import torch
from conftest import random_prompts

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.sampling.sampler import Sampler


def _draw(params: SamplingParams, logits: torch.Tensor, rows: int, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(torch.Generator().manual_seed(seed))
    batch = logits.expand(rows, -1).contiguous()
    return torch.tensor(sampler(batch, [params] * rows, [None] * rows).tokens)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2]])


def test_greedy_rows_take_the_argmax():
    sampler = Sampler()
    logits = torch.randn(5, 50)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)] * 2 + [SamplingParams()]
    assert sampler(logits, params, [None] * 5).tokens == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    draws = _draw(SamplingParams(temperature=0.7), LOGITS, 40000)
    freq = torch.bincount(draws, minlength=8).float() / draws.numel()
    expected = torch.softmax(LOGITS[0] / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.01)


def test_top_k_keeps_only_the_k_best():
    draws = _draw(SamplingParams(temperature=1.0, top_k=3), LOGITS, 20000)
    assert set(draws.tolist()) == {0, 1, 2}
    freq = torch.bincount(draws, minlength=8).float()[:3] / draws.numel()
    assert torch.allclose(freq, torch.softmax(LOGITS[0, :3], -1), atol=0.015)


def test_top_p_keeps_the_nucleus():
    probs = torch.softmax(LOGITS[0], -1)  # 0.39, 0.24, 0.14, ...: top_p=0.7 keeps 3 tokens
    assert probs[:2].sum() < 0.7 < probs[:3].sum()
    draws = _draw(SamplingParams(temperature=1.0, top_p=0.7), LOGITS, 20000)
    assert set(draws.tolist()) == {0, 1, 2}
    tiny = _draw(SamplingParams(temperature=1.0, top_p=1e-6), LOGITS, 200)
    assert set(tiny.tolist()) == {0}


def test_mixed_rows_use_their_own_settings():
    sampler = Sampler(torch.Generator().manual_seed(1))
    logits = LOGITS.expand(4, -1).contiguous()
    params = [
        SamplingParams(),
        SamplingParams(temperature=5.0, top_k=2),
        SamplingParams(temperature=5.0, top_p=0.3),
        SamplingParams(temperature=5.0),
    ]
    for _ in range(50):
        tokens = sampler(logits, params, [None] * 4).tokens
        assert tokens[0] == 0 and tokens[1] in (0, 1) and tokens[2] in (0, 1, 2)


def test_seeds_make_requests_reproducible(llama):
    prompts = random_prompts(4, 3, 12, seed=21)
    config = EngineConfig(num_blocks=64, block_size=8)

    def run(seeds):
        params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s) for s in seeds]
        return [o.token_ids for o in cbgen.generate_batch(llama, prompts, params, config)]

    first = run([1, 2, 3, 4])
    assert run([1, 2, 3, 4]) == first
    # A request's draws depend on its own seed, not on its neighbours.
    assert run([1, 9, 3, 8])[0] == first[0]
    assert run([5, 6, 7, 8])[0] != first[0]
