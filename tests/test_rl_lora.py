"""RL with a ``peft`` (LoRA) model: ``cbgen.rollout`` runs the base model with the adapter
in a cbgen LoRA slot (peft's wrappers stepped aside), exact against the peft model; an
engine kept across training steps syncs only the adapter (``PeftRollouts``, and TRL's
GRPO with a ``peft_config``); ``pause(keep_weights=True)`` keeps the packed base."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import make_tiny_model, random_prompts, reference_greedy

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.rl.peft_rollouts import PeftRollouts
from cbgen.rl.peft_target import PeftTarget

peft = pytest.importorskip("peft")


def make_peft(base: torch.nn.Module, seed: int = 1, **settings) -> torch.nn.Module:
    """A peft model over a copy of ``base`` with random (not zero) LoRA weights."""
    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **settings}
    config = peft.LoraConfig(init_lora_weights=False, **settings)
    return peft.get_peft_model(copy.deepcopy(base), config).eval()


def training_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def worst_logprob_gap(model, samples) -> float:
    worst = 0.0
    for prompt, completion, logprobs in zip(
        samples.prompt_ids, samples.completion_ids, samples.logprobs, strict=True
    ):
        want = training_logprobs(model, prompt, completion)
        worst = max(worst, float((torch.tensor(logprobs) - want).abs().max()))
    return worst


def snapshot(model):
    """What a trainer relies on: the module tree (objects), each module's own forward,
    training flag and hooks, the attention implementation."""
    return (
        [
            (name, module, module.training, len(module._forward_hooks))
            for name, module in model.named_modules()
        ],
        [name for name, module in model.named_modules() if "forward" in module.__dict__],
        model.get_base_model().config._attn_implementation,
    )


def bump_adapter(model, factor: float = 3.0) -> None:
    """An optimizer step's worth of change, in place, on the adapter only."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(factor)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rollout_on_a_peft_model_is_its_generate_and_its_forward(arch):
    model = make_peft(make_tiny_model(arch))
    prompts = random_prompts(3, 4, 10, seed=2)
    greedy = cbgen.rollout(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    for prompt, completion in zip(prompts, greedy.completion_ids, strict=True):
        assert completion == reference_greedy(model, prompt, 8)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    samples = cbgen.rollout(model, prompts, params, num_samples=3)
    assert worst_logprob_gap(model, samples) < 1e-4
    # The adapter is applied: the base model alone gives those tokens other logprobs.
    with model.disable_adapter():
        base_only = worst_logprob_gap(model, samples)
    assert base_only > 1e-2, base_only


def test_after_a_rollout_the_peft_model_is_the_trainers_again():
    model = make_peft(make_tiny_model("llama"))
    model.train()
    model.base_model.model.lm_head.eval()  # a mixed set of flags stays as it was
    model.enable_input_require_grads()  # as a trainer with gradient checkpointing does
    ids = torch.tensor([random_prompts(1, 8, 8, seed=9)[0]])
    with torch.no_grad():
        before_logits = model(input_ids=ids).logits
    before = snapshot(model)
    cbgen.rollout(model, ids.tolist(), SamplingParams(max_new_tokens=4))
    assert snapshot(model) == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before_logits)
    # The same after an error inside the engine's lifetime (an empty prompt).
    with pytest.raises(ValueError, match="rollout-0.0"):
        cbgen.rollout(model, [[]], SamplingParams(max_new_tokens=4))
    assert snapshot(model) == before
    # Training still reaches the adapter through peft's own modules.
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("prepack", [None, False])  # adapters on packed maps, on modules
def test_a_kept_engine_syncs_the_adapter_and_keeps_the_packed_base(prepack):
    model = make_peft(make_tiny_model("llama"))
    prompts = random_prompts(2, 4, 8, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    config = EngineConfig(block_size=4, prepack_linear=prepack)
    with PeftRollouts(model, config) as policy:
        first = policy.rollout(prompts, params, 2)
        assert first == cbgen.rollout(model, prompts, params, 2, config=config)
        engine = policy.engine
        assert engine is not None and engine.is_paused
        runner = engine.executor.runner
        between = snapshot(model)
        assert between[1] == []  # no cbgen forward left on any module between rollouts
        bump_adapter(model)  # the training step
        second = policy.rollout(prompts, params, 2)
        assert policy.engine is engine and engine.executor.runner is runner  # not rebuilt
        assert second != first
        assert second == cbgen.rollout(model, prompts, params, 2, config=config)  # new adapter
        assert worst_logprob_gap(model, second) < 1e-4
        assert snapshot(model) == between
        model.add_adapter("other", peft.LoraConfig(r=2, target_modules="all-linear"))
        model.set_adapter("other")
        with pytest.raises(ValueError, match="no longer 'default'"):
            policy.rollout(prompts, params, 2)
        assert snapshot(model)[0] != between[0]  # the new adapter's modules, nothing else
        assert snapshot(model)[1:] == between[1:]
    assert policy.engine is None


def tiny(arch: str) -> torch.nn.Module:
    if arch != "mamba":
        return make_tiny_model(arch)
    from architectures import build_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()


# The fast decoder, transformers' modules, and state layers on cbgen's slots.
@pytest.mark.parametrize("arch", ["llama", "gemma2", "mamba"])
def test_pause_keeping_the_weights_resumes_without_a_rebuild_unless_they_changed(arch):
    model = tiny(arch)
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    params = SamplingParams(max_new_tokens=6)
    original_attention = model.config._attn_implementation
    with EngineCore(model, EngineConfig(block_size=4)) as engine:
        first = cbgen.rollout(engine, [prompt], params).completion_ids
        runner = engine.executor.runner
        engine.pause(keep_weights=True)
        assert model.config._attn_implementation == original_attention
        assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
        engine.resume()
        assert engine.executor.runner is runner
        assert cbgen.rollout(engine, [prompt], params).completion_ids == first
        # A base weight changed while paused: noticed, the executor rebuilt from it.
        engine.pause(keep_weights=True)
        linear = next(
            m
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and "head" not in n
        )
        with torch.no_grad():
            linear.weight.mul_(-1.0)
        engine.resume()
        assert engine.executor.runner is not runner
        got = cbgen.rollout(engine, [prompt], params).completion_ids[0]
        # sleep() after a pause that kept them frees them too.
        runner = engine.executor.runner
        engine.pause(keep_weights=True)
        engine.sleep()
        engine.wake()
        assert engine.executor.runner is not runner
        assert cbgen.rollout(engine, [prompt], params).completion_ids[0] == got
    assert got != first[0] and got == reference_greedy(model, prompt, 6)


def test_what_cbgen_cannot_serve_from_a_peft_model_is_refused():
    base = make_tiny_model("llama")
    merged = make_peft(base)
    merged.merge_adapter()
    with pytest.raises(ValueError, match="merged"):
        cbgen.rollout(merged, [[5, 6, 7]])
    disabled = make_peft(base)
    with disabled.disable_adapter(), pytest.raises(ValueError, match="disabled"):
        cbgen.rollout(disabled, [[5, 6, 7]])
    with pytest.raises(ValueError, match="modules_to_save"):
        PeftTarget(make_peft(base, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="open EngineCore"):
        cbgen.rollout(base, [[5, 6, 7]], lora="policy")


def test_grpo_with_a_lora_peft_config_trains_on_kept_engine_rollouts(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from test_server import smollm2_tokenizer, tiny_model
    from test_trl import GRPO_PROMPTS, grpo_args, reward_len

    from cbgen.rl.trl import grpo_rollout_func

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = smollm2_tokenizer()
    model = tiny_model(tokenizer)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    backend = grpo_rollout_func()
    runners, gaps = [], []

    def rollout_func(prompts, trainer):
        out = backend(prompts, trainer)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        assert isinstance(policy, peft.PeftModel)
        assert backend.peft is not None and backend.peft.engine is not None
        runners.append(backend.peft.engine.executor.runner)
        for prompt, completion, logprobs in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
        ):
            if completion:  # the policy's logprobs: a training forward agrees
                want = training_logprobs(policy, prompt, completion)
                gaps.append(float((torch.tensor(logprobs) - want).abs().max()))
        return out

    args = grpo_args(tmp_path)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": GRPO_PROMPTS}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        peft_config=lora,
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    adapter_before = {k: v.clone() for k, v in policy.named_parameters() if "lora_" in k}
    trainer.train()
    assert len(runners) == 2 and runners[0] is runners[1]  # one engine, its base packed once
    assert backend.peft is None  # closed when training ended
    assert gaps and max(gaps) < 1e-4, gaps
    adapter_after = {k: v for k, v in policy.named_parameters() if k in adapter_before}
    assert any(not torch.equal(v, adapter_before[k]) for k, v in adapter_after.items())
    base_after = {
        k.replace(".base_layer", ""): v
        for k, v in policy.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(v, base_before[k]) for k, v in base_after.items())  # frozen
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    assert os.environ.get("TRL_EXPERIMENTAL_SILENCE") == "1"
