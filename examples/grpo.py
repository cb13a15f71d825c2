"""GRPO with cbgen generating the groups: a small, complete policy-gradient loop.

    .venv/bin/python examples/grpo.py                    # a tiny model, toy arithmetic
    .venv/bin/python examples/grpo.py --model smollm2    # the bundled SmolLM2 (slow on CPU)

The task, written for this example, has answers a program can check: a prompt asks for
``a + b``; the reward is 1 when the completion starts with the sum's last digit
(the tiny model: 9 problems, ``a, b < 3``; SmolLM2: 16 random one-digit sums). Each step samples ``--group`` completions per prompt with ``cbgen.rollout``
on one open engine, normalizes each group's rewards into advantages (reward minus
the group's mean, over its standard deviation), and takes one optimizer step on the
clipped policy loss (PPO's, with the logprobs of the rollout as the old policy's; no KL
term) over the logprobs recomputed by a training forward. Between rollouts the engine
sleeps (its KV cache and packed weights freed) while the model trains, and wakes to the
new weights. It prints each step's mean reward and, for the first step, how far the
rollout's logprobs are from the training forward's (they are the same policy).

The tiny model is a 2-layer Llama over a 16-token vocabulary: digits, ``+``, ``=`` and
the special tokens; ``run()`` is what the tests call.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

import torch
import transformers

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams

DIGITS = list(range(10))  # token id = digit in the tiny vocabulary
PLUS, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14
VOCAB = 16


@dataclass
class Task:
    """The prompts (token ids), their answers and how to read a completion."""

    prompts: list[list[int]]
    answers: list[int]
    decode: object = None  # a tokenizer for a text model; None: the tiny vocabulary

    def reward(self, index: int, completion: list[int]) -> float:
        if self.decode is None:
            return float(bool(completion) and completion[0] == self.answers[index])
        text = self.decode.decode(completion, skip_special_tokens=True).strip()  # type: ignore[attr-defined]
        digits = "".join(ch for ch in text[:4] if ch.isdigit())
        return float(digits[-1:] == str(self.answers[index]))


@dataclass
class History:
    rewards: list[float] = field(default_factory=list)
    first_logprob_gap: float | None = None


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_task(seed: int = 0, size: int = 3) -> Task:
    """Every ``a + b`` with ``a, b < size``, shuffled."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(size) for b in range(size)]
    rng.shuffle(pairs)
    prompts = [[BOS, a, PLUS, b, EQUALS] for a, b in pairs]
    return Task(prompts, [(a + b) % 10 for a, b in pairs])


def text_task(tokenizer, seed: int = 0) -> Task:
    from cbgen.bench.workloads import chat_token_ids

    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(16)]
    prompts = [
        chat_token_ids(tokenizer, f"What is {a} + {b}? Answer with the number only.")
        for a, b in pairs
    ]
    return Task(prompts, [(a + b) % 10 for a, b in pairs], decode=tokenizer)


def completion_logprobs(model, prompts, completions) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward: each completion token's logprob under ``model`` (with
    gradients), right-padded to ``[rows, longest]``, and the padding mask."""
    width = max(len(c) for c in completions)
    rows = []
    mask = torch.zeros(len(completions), width)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(picked, (0, width - len(completion))))
        mask[row, : len(completion)] = 1.0
    return torch.stack(rows), mask


def grpo_step(model, optimizer, task, batch, rollout, clip: float = 0.2) -> float:
    """One optimizer step on the clipped GRPO loss; returns the mean reward."""
    rewards = torch.tensor(
        [
            task.reward(batch[g], c)
            for g, c in zip(rollout.group, rollout.completion_ids, strict=True)
        ]
    )
    grouped = rewards.view(-1, rollout.num_samples)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    advantages = advantages.view(-1, 1)
    old = rollout.tensors()["logprobs"]
    model.train()
    new, mask = completion_logprobs(model, rollout.prompt_ids, rollout.completion_ids)
    ratio = torch.exp(new - old)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    loss = ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    model.eval()
    return float(rewards.mean())


def run(
    model,
    task: Task,
    steps: int,
    prompts_per_step: int = 8,
    group: int = 8,
    max_new_tokens: int = 2,
    lr: float = 5e-3,
    seed: int = 0,
    config: EngineConfig | None = None,
    log: bool = False,
) -> History:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = History()
    with EngineCore(model, config or EngineConfig()) as engine:
        for step in range(steps):
            batch = rng.sample(range(len(task.prompts)), prompts_per_step)
            params = SamplingParams(
                temperature=1.0, max_new_tokens=max_new_tokens, seed=rng.randrange(1 << 30)
            )
            samples = cbgen.rollout(engine, [task.prompts[i] for i in batch], params, group)
            engine.sleep()  # the model is the trainer's; the engine's memory is free
            if step == 0:
                with torch.no_grad():
                    new, mask = completion_logprobs(
                        model, samples.prompt_ids, samples.completion_ids
                    )
                gap = ((new - samples.tensors()["logprobs"]).abs() * mask).max()
                history.first_logprob_gap = float(gap)
            history.rewards.append(grpo_step(model, optimizer, task, batch, samples))
            engine.wake()  # new weights: packed again, K/V computed afresh
            if log:
                print(f"step {step + 1:3d}  mean reward {history.rewards[-1]:.3f}", flush=True)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, or a bundled name (smollm2)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model == "tiny":
        model, task = tiny_model(args.seed), tiny_task(args.seed)
        history = run(model, task, args.steps, group=args.group, lr=args.lr or 5e-3, log=True)
    else:
        model, tokenizer = cbgen.load_model(args.model)
        task = text_task(tokenizer, args.seed)
        history = run(
            model,
            task,
            args.steps,
            prompts_per_step=4,
            group=args.group,
            max_new_tokens=4,
            lr=args.lr or 1e-5,
            log=True,
        )
    print(f"rollout vs training-forward logprobs, largest gap: {history.first_logprob_gap:.2e}")
    first = statistics.mean(history.rewards[:5])
    last = statistics.mean(history.rewards[-5:])
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")


if __name__ == "__main__":
    main()
