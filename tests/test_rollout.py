"""``cbgen.rl.rollout``: groups of samples with the logprob of every sampled token, the
same a training forward computes; and the GRPO example learns its toy task."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model, random_prompts

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _training_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3"])
def test_rollout_logprobs_equal_a_training_forward(arch):
    model = make_tiny_model(arch)
    prompts = random_prompts(3, 4, 12, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    samples = cbgen.rollout(
        model, prompts, params, num_samples=4, config=EngineConfig(block_size=4)
    )
    assert len(samples) == 12 and samples.group == [0] * 4 + [1] * 4 + [2] * 4
    worst = 0.0
    for prompt, completion, logprobs in zip(
        samples.prompt_ids, samples.completion_ids, samples.logprobs, strict=True
    ):
        want = _training_logprobs(model, prompt, completion)
        worst = max(worst, float((torch.tensor(logprobs) - want).abs().max()))
    assert worst < 1e-4, worst


def test_rollout_rows_tensors_and_seeds():
    model = make_tiny_model("llama")
    prompts = random_prompts(2, 4, 8, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    first = cbgen.rollout(model, prompts, params, num_samples=3)
    again = cbgen.rollout(model, prompts, params, num_samples=3)
    assert first == again  # seeded: sample i of each prompt uses seed + i
    assert len({tuple(c) for c in first.completion_ids[:3]}) > 1  # the samples differ
    assert first.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3
    assert set(first.finish_reasons) <= {"eos", "length"}
    batch = first.tensors(pad_token_id=0)
    lengths = [len(c) for c in first.completion_ids]
    assert batch["completion_ids"].shape == (6, max(lengths))
    assert batch["completion_mask"].sum(1).tolist() == lengths
    for row, values in enumerate(first.logprobs):
        assert batch["logprobs"][row, : len(values)].tolist() == pytest.approx(values)
    assert batch["group"].tolist() == first.group


def test_rollout_on_an_open_engine_and_its_errors():
    model = make_tiny_model("llama")
    prompts = random_prompts(2, 4, 8, seed=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    expected = cbgen.rollout(model, prompts, params, num_samples=2)
    with EngineCore(model, EngineConfig()) as engine:
        assert cbgen.rollout(engine, prompts, params, num_samples=2) == expected
        with pytest.raises(ValueError, match="num_samples"):
            cbgen.rollout(engine, prompts, params, num_samples=0)
        with pytest.raises(ValueError, match="num_samples, not params.n"):
            cbgen.rollout(engine, prompts, SamplingParams(n=2), num_samples=2)
        with pytest.raises(ValueError, match="request 'rollout-1.0'"):
            cbgen.rollout(engine, [prompts[0], []], params, num_samples=2)
        assert not engine.has_unfinished()  # the valid prompt's samples were withdrawn
        engine.add_request(prompts[0], params, "other")
        with pytest.raises(ValueError, match="no unfinished requests"):
            cbgen.rollout(engine, prompts, params)
        assert engine.allocator.num_free == engine.allocator.num_blocks or engine.abort("other")


def _grpo():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLES / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_example"] = module
    spec.loader.exec_module(module)
    return module


def test_the_grpo_example_learns_its_toy_task():
    """Seeded: the tiny model's reward goes up over the steps, and the rollout's
    logprobs are the training forward's (the same policy before the first update)."""
    grpo = _grpo()
    history = grpo.run(grpo.tiny_model(0), grpo.tiny_task(0), steps=40, seed=0)
    # On this machine: 0.11 over the first eight steps, 0.57 over the last eight.
    assert history.first_logprob_gap < 1e-4
    first, last = history.rewards[:8], history.rewards[-8:]
    assert sum(last) / 8 > sum(first) / 8 + 0.2, history.rewards
