"""TRL's ``GRPOTrainer`` with cbgen generating its groups (``cbgen.rl.trl``)."""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_server import smollm2_tokenizer, tiny_model  # noqa: E402

from cbgen.rl.trl import grpo_rollout_func  # noqa: E402

GRPO_PROMPTS = ["Count to five.", "Name a color.", "Say hello.", "Pick a number."]


def reward_len(completions, **kwargs):
    """A reward that needs no model: longer completions score higher."""
    return [float(len(c)) / 40 for c in completions]


def grpo_args(tmp_path):
    """Two GRPO steps of 4 prompts x 4 samples of 8 tokens on CPU: the smallest run that
    rolls out, scores and trains twice."""
    return trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        temperature=1.0,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )


def test_grpo_trainer_trains_on_cbgen_rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = smollm2_tokenizer()
    model = tiny_model(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[tuple[int, int]] = []
    backend = grpo_rollout_func()

    def rollout_func(prompts, trainer):
        out = backend(prompts, trainer)
        calls.append((len(prompts), len(out["completion_ids"])))
        # The logprobs are the policy's: a training forward on the same tokens agrees.
        ids = out["prompt_ids"][0] + out["completion_ids"][0]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        start = len(out["prompt_ids"][0])
        want = torch.log_softmax(logits[start - 1 : -1], -1)
        want = want.gather(1, torch.tensor(out["completion_ids"][0])[:, None])[:, 0]
        assert (torch.tensor(out["logprobs"][0]) - want).abs().max() < 1e-4
        return out

    dataset = datasets.Dataset.from_dict({"prompt": GRPO_PROMPTS})
    args = grpo_args(tmp_path)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.train()
    assert calls and all(n == rows for n, rows in calls)  # a row per prompt entry
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [h for h in trainer.state.log_history if "loss" in h]
    assert os.environ.get("TRL_EXPERIMENTAL_SILENCE") == "1"
