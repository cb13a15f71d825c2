"""Multi-LoRA: rows of several PEFT adapters and base rows in one batch, token-identical
to each ``peft`` model's own ``generate()`` (float32, adapter not merged)."""

from __future__ import annotations

import copy
import time

import peft
import pytest
import torch
from conftest import make_tiny_model, random_prompts, reference_greedy, run_until_done

from cbgen import Engine, EngineConfig, SamplingParams, SpeculativeConfig, generate_batch
from cbgen.core.engine_core import EngineCore

# Four adapters of different shapes: every linear map, rsLoRA, one layer only, a rank
# pattern, so slots of different ranks and different module sets share a step.
ADAPTERS = [
    dict(r=8, lora_alpha=16, target_modules="all-linear"),
    dict(r=4, lora_alpha=4, target_modules="all-linear", use_rslora=True),
    dict(
        r=16,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        layers_to_transform=[1],
    ),
    dict(r=2, lora_alpha=8, target_modules="all-linear", rank_pattern={"down_proj": 6}),
]


def make_adapter(base: torch.nn.Module, seed: int, strength: float = 2.0, **settings):
    """A ``peft`` model over a copy of ``base`` with random (not zero) LoRA weights."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **settings)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(strength)
    return model


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    base = make_tiny_model("llama")
    folders, models = [], []
    for index, settings in enumerate(ADAPTERS):
        model = make_adapter(base, 100 + index, **settings)
        folder = tmp_path_factory.mktemp(f"adapter{index}")
        model.save_pretrained(folder)
        folders.append(str(folder))
        models.append(peft.PeftModel.from_pretrained(copy.deepcopy(base), folder).eval())
    return base, folders, models


def _run_mixed(base, folders, models, prompts, max_new_tokens=8, **config):
    """Every prompt under the base and under each adapter, all in one engine; returns
    (got, want) token lists."""
    engine = EngineCore(copy.deepcopy(base), EngineConfig(block_size=4, **config))
    with engine:
        for index, folder in enumerate(folders):
            engine.add_lora(f"a{index}", folder)
        expected = {}
        params = SamplingParams(max_new_tokens=max_new_tokens)
        for p, prompt in enumerate(prompts):
            for index in [None, *range(len(folders))]:
                lora = None if index is None else f"a{index}"
                rid = engine.add_request(prompt, params, request_id=f"{p}-{lora}", lora=lora)
                reference = base if index is None else models[index]
                expected[rid] = reference_greedy(reference, prompt, max_new_tokens)
        results = run_until_done(engine)
        assert engine.allocator.num_free == engine.allocator.num_blocks
    got = {rid: results[rid].token_ids for rid in expected}
    return got, expected


def test_adapters_change_the_output(llama_adapters):
    base, _, models = llama_adapters
    prompt = random_prompts(1, 6, 7, seed=3)[0]
    outputs = {tuple(reference_greedy(m, prompt, 8)) for m in [base, *models]}
    assert len(outputs) == 5, "each adapter must move the greedy output for the test to mean much"


MIXES = [
    pytest.param({}, id="plain"),
    pytest.param(dict(max_batch_tokens=8), id="chunked"),
    pytest.param(dict(num_blocks=24, max_batch_tokens=32), id="preempted"),
    pytest.param(
        dict(num_blocks=24, max_batch_tokens=32, preemption_mode="swap"), id="preempted-swap"
    ),
    pytest.param(dict(async_scheduling=True), id="async"),
    pytest.param(dict(prepack_linear=False), id="torch-linear"),
]


@pytest.mark.parametrize("mix", MIXES)
def test_mixed_adapters_match_peft(llama_adapters, mix):
    base, folders, models = llama_adapters
    prompts = random_prompts(3, 5, 14, seed=1)
    got, want = _run_mixed(base, folders, models, prompts, **mix)
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_speculation_under_adapters_is_exact(llama_adapters, method):
    """Guesses come from the base (prompt lookup, or the base's first layers); the
    adapter's own pass verifies them, so the output stays the peft model's."""
    base, folders, models = llama_adapters
    extra = dict(num_layers=1) if method == "layer_skip" else {}
    spec = SpeculativeConfig(
        method=method, num_tokens=3, disable_batch_size=None, adaptive=False, **extra
    )
    prompts = [p + p for p in random_prompts(2, 5, 9, seed=9)]  # repeats for prompt lookup
    got, want = _run_mixed(base, folders[:2], models[:2], prompts, speculative=spec)
    assert got == want


def test_prefix_cache_is_keyed_by_adapter(llama_adapters):
    base, folders, models = llama_adapters
    prompt = random_prompts(1, 17, 18, seed=5)[0]  # four full blocks of 4
    params = SamplingParams(max_new_tokens=4)
    with EngineCore(copy.deepcopy(base), EngineConfig(block_size=4)) as engine:
        engine.add_lora("a", folders[0])
        engine.add_lora("b", folders[1])
        runs = [("first-a", "a"), ("again-a", "a"), ("then-b", "b"), ("base", None)]
        outputs = {}
        for rid, lora in runs:
            engine.add_request(prompt, params, request_id=rid, lora=lora)
            outputs.update(run_until_done(engine))
    assert outputs["first-a"].num_cached_tokens == 0
    assert outputs["again-a"].num_cached_tokens == 16
    assert outputs["then-b"].num_cached_tokens == 0  # a's K/V is not b's
    assert outputs["base"].num_cached_tokens == 0
    assert outputs["then-b"].token_ids == reference_greedy(models[1], prompt, 4)
    assert outputs["base"].token_ids == reference_greedy(base, prompt, 4)


def test_generate_batch_takes_adapters_per_prompt(llama_adapters):
    base, folders, models = llama_adapters
    prompts = random_prompts(4, 5, 9, seed=7)
    sources = [folders[0], None, models[2], folders[0]]
    outputs = generate_batch(
        copy.deepcopy(base), prompts, SamplingParams(max_new_tokens=6), lora=sources
    )
    references = [models[0], base, models[2], models[0]]
    for output, prompt, reference in zip(outputs, prompts, references, strict=True):
        assert output.token_ids == reference_greedy(reference, prompt, 6)


def test_update_lora_in_place(llama_adapters):
    base, folders, _ = llama_adapters
    prompt = random_prompts(1, 9, 10, seed=11)[0]
    params = SamplingParams(max_new_tokens=6)
    trained = make_adapter(base, 300, r=8, lora_alpha=16, target_modules="all-linear")
    with EngineCore(copy.deepcopy(base), EngineConfig(block_size=4)) as engine:
        engine.add_lora("policy", folders[0])
        before = engine.executor.runner
        state = peft.get_peft_model_state_dict(trained)
        assert engine.update_lora("policy", state) == len(state) // 2
        assert engine.executor.runner is before  # no rebuild of the base
        engine.add_request(prompt, params, request_id="r", lora="policy")
        out = run_until_done(engine)["r"]
    assert out.token_ids == reference_greedy(trained, prompt, 6)


def test_adapters_survive_a_rebuild_of_the_base(llama_adapters):
    """refresh(), pause()/resume() and sleep()/wake() build the packed base again; the
    adapters hook onto the new maps."""
    base, folders, models = llama_adapters
    prompt = random_prompts(1, 7, 8, seed=14)[0]
    want = reference_greedy(models[0], prompt, 5)
    with EngineCore(copy.deepcopy(base), EngineConfig(block_size=4)) as engine:
        engine.add_lora("a", folders[0])
        for change in (engine.refresh, lambda: (engine.pause(), engine.resume()), engine.wake):
            change()
            engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id="r", lora="a")
            assert run_until_done(engine)["r"].token_ids == want
            engine.sleep()


def test_update_lora_restarts_running_requests(llama_adapters):
    base, folders, models = llama_adapters
    prompt = random_prompts(1, 9, 10, seed=12)[0]
    with EngineCore(copy.deepcopy(base), EngineConfig(block_size=4)) as engine:
        engine.add_lora("policy", folders[0])
        engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id="r", lora="policy")
        engine.step()  # the prompt's K/V is computed under the old weights
        trained = make_adapter(base, 301, **ADAPTERS[0])
        engine.update_lora("policy", peft.get_peft_model_state_dict(trained))
        out = run_until_done(engine)["r"]
    # The first token came from the old weights; the rest from the new, over K/V
    # computed again with them: the same as the new adapter continuing that token.
    first = reference_greedy(models[0], prompt, 1)
    assert out.token_ids[:1] == first
    assert out.token_ids[1:] == reference_greedy(trained, prompt + first, 5)


def test_update_lora_is_fast_on_the_bundled_model(smollm2):
    model = copy.deepcopy(smollm2[0])
    adapter = make_adapter(model, 7, r=16, lora_alpha=32, target_modules="all-linear")
    state = peft.get_peft_model_state_dict(adapter)
    with EngineCore(model, EngineConfig(num_blocks=16)) as engine:
        engine.add_lora("policy", adapter)
        engine.update_lora("policy", state)
        # Not a timing assertion: the update must not rebuild anything.
        before = engine.executor.runner
        started = time.perf_counter()
        engine.update_lora("policy", state)
        elapsed = time.perf_counter() - started
        assert engine.executor.runner is before
    print(f"update_lora on SmolLM2 (rank 16, {len(state) // 2} maps): {elapsed * 1e3:.1f} ms")


def test_a_live_peft_model_is_watched(llama_adapters):
    base, _, _ = llama_adapters
    trainer = make_adapter(base, 400, r=4, lora_alpha=8, target_modules="all-linear")
    prompt = random_prompts(1, 7, 8, seed=13)[0]
    with EngineCore(copy.deepcopy(base), EngineConfig(block_size=4)) as engine:
        engine.add_lora("live", trainer)
        with torch.no_grad():  # an optimizer step, in place, not announced
            for name, param in trainer.named_parameters():
                if "lora_B" in name:
                    param.mul_(-1.5)
        engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id="r", lora="live")
        out = run_until_done(engine)["r"]
    assert out.token_ids == reference_greedy(trainer, prompt, 6)


ARCH_TARGETS = {
    "qwen2": "all-linear",
    "qwen3": "all-linear",
    "mistral": "all-linear",
    "phi3": "all-linear",  # fused qkv_proj and gate_up_proj modules
    "gemma2": "all-linear",
    "gpt_neox": "all-linear",
    "opt": "all-linear",
    "phi": "all-linear",
    "qwen2_moe": "all-linear",  # attention, the router and the shared expert (not experts)
}


@pytest.mark.parametrize("arch", sorted(ARCH_TARGETS))
def test_architectures_match_peft(arch, tmp_path):
    if arch == "qwen2_moe":
        from architectures import build_config
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(build_config(arch)).eval()
    else:
        base = make_tiny_model(arch)
    folders, models = [], []
    for index, settings in enumerate(
        [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=8, use_rslora=True)]
    ):
        model = make_adapter(base, 500 + index, target_modules=ARCH_TARGETS[arch], **settings)
        model.save_pretrained(tmp_path / str(index))
        folders.append(str(tmp_path / str(index)))
        models.append(model)
    prompts = random_prompts(2, 5, 12, seed=2)
    got, want = _run_mixed(base, folders, models, prompts, max_new_tokens=6)
    assert got == want


def test_the_online_engine_serves_adapters(llama_adapters):
    base, folders, models = llama_adapters
    prompts = random_prompts(3, 5, 9, seed=21)
    with Engine(copy.deepcopy(base), config=EngineConfig(block_size=4)) as engine:
        engine.add_lora("a", folders[0])
        engine.add_lora("b", models[1])
        assert [info.name for info in engine.list_loras()] == ["a", "b"]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
            engine.add_request(prompts[0], SamplingParams(max_new_tokens=5), lora="c")
        params = SamplingParams(max_new_tokens=5)
        ids = [
            engine.add_request(p, params, lora=lora)
            for p, lora in zip(prompts, ["a", None, "b"], strict=True)
        ]
        outs = [engine.get_result(rid, timeout=60) for rid in ids]
        references = [models[0], base, models[1]]
        for out, prompt, reference in zip(outs, prompts, references, strict=True):
            assert out.token_ids == reference_greedy(reference, prompt, 5)
        engine.update_lora("a", peft.get_peft_model_state_dict(models[0]))
        engine.remove_lora("b")
        assert [info.name for info in engine.list_loras()] == ["a"]
        # Paused with the packed base kept (LoRA training), then an adapter update.
        runner = engine.core.executor.runner
        engine.pause(keep_weights=True)
        engine.update_lora("a", peft.get_peft_model_state_dict(models[0]))
        engine.resume()
        assert engine.core.executor.runner is runner
        again = engine.get_result(engine.add_request(prompts[0], params, lora="a"), timeout=60)
        assert again.token_ids == reference_greedy(models[0], prompts[0], 5)


# -- refusals -----------------------------------------------------------------------------


@pytest.fixture
def engine():
    with EngineCore(make_tiny_model("llama"), EngineConfig(block_size=4, max_loras=2)) as e:
        yield e


def test_unknown_adapter_is_refused_alone(engine, llama_adapters):
    _, folders, _ = llama_adapters
    engine.add_lora("a", folders[0])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'.*loaded: a"):
        engine.add_request([1, 2, 3], lora="nope")
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), lora="a")
    assert len(run_until_done(engine)) == 1
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_rank_over_the_limit_is_refused(tmp_path):
    base = make_tiny_model("llama")
    make_adapter(base, 1, r=16, target_modules=["q_proj"]).save_pretrained(tmp_path)
    config = EngineConfig(block_size=4, max_lora_rank=8)
    with (
        EngineCore(base, config) as engine,
        pytest.raises(ValueError, match="rank 16.*max_lora_rank=8"),
    ):
        engine.add_lora("big", str(tmp_path))


def test_adapter_for_another_model_is_refused(tmp_path):
    wider = make_tiny_model("llama", hidden_size=96)
    make_adapter(wider, 1, r=4, target_modules=["q_proj"]).save_pretrained(tmp_path / "w")
    other = make_tiny_model("gpt_neox")
    make_adapter(other, 1, r=4, target_modules=["query_key_value"]).save_pretrained(tmp_path / "n")
    with EngineCore(make_tiny_model("llama"), EngineConfig(block_size=4)) as engine:
        with pytest.raises(ValueError, match=r"q_proj: lora_A has shape \(4, 96\)"):
            engine.add_lora("wider", str(tmp_path / "w"))
        with pytest.raises(ValueError, match="no module 'gpt_neox.layers.0.attention"):
            engine.add_lora("neox", str(tmp_path / "n"))
        assert engine.list_loras() == []


def test_unsupported_adapter_kinds_are_refused(tmp_path):
    base = make_tiny_model("llama")
    make_adapter(base, 1, r=4, target_modules=["q_proj"], use_dora=True).save_pretrained(
        tmp_path / "dora"
    )
    make_adapter(base, 1, r=4, target_modules=["lm_head"]).save_pretrained(tmp_path / "head")
    make_adapter(base, 1, r=4, target_modules=["embed_tokens"]).save_pretrained(tmp_path / "emb")
    with EngineCore(base, EngineConfig(block_size=4)) as engine:
        with pytest.raises(ValueError, match="DoRA"):
            engine.add_lora("dora", str(tmp_path / "dora"))
        with pytest.raises(ValueError, match="LM head"):
            engine.add_lora("head", str(tmp_path / "head"))
        with pytest.raises(ValueError, match="embedding LoRA"):
            engine.add_lora("emb", str(tmp_path / "emb"))
        with pytest.raises(ValueError, match="not a PEFT adapter folder"):
            engine.add_lora("none", str(tmp_path))


@pytest.mark.parametrize("arch", ["mixtral", "jamba"])
def test_experts_and_state_layers_are_refused(arch, tmp_path):
    from architectures import build_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(build_config(arch)).eval()
    make_adapter(base, 1, r=4, target_modules="all-linear").save_pretrained(tmp_path)
    reason = "mixture-of-experts experts" if arch == "mixtral" else "inside a state layer"
    with EngineCore(base, EngineConfig(block_size=4)) as engine:
        with pytest.raises(ValueError, match=reason):
            engine.add_lora("a", str(tmp_path))


def test_malformed_folders_are_value_errors(tmp_path):
    """Whatever is wrong with a folder, the reader says so with a ValueError (the server
    answers it with a 400), and never asks the Hub for a folder without weights."""
    from cbgen.core.lora_source import read_adapter

    cases = {
        "not-json": ("{", "not JSON"),
        "a-list": ("[1, 2]", "not a JSON object"),
        "bad-alpha": ('{"lora_alpha": "x"}', "lora_alpha must be a number"),
        "bad-pattern": ('{"alpha_pattern": [1]}', "alpha_pattern must be an object"),
        "no-weights": ("{}", "no adapter weights"),
    }
    for name, (config, message) in cases.items():
        folder = tmp_path / "org" / name  # a Hub-shaped relative name must not go online
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(config)
        with pytest.raises(ValueError, match=message):
            read_adapter(folder)
    with pytest.raises(ValueError, match="cannot read the folder|not a PEFT adapter folder"):
        read_adapter("/" + "x" * 5000)


def test_gpt2_conv1d_is_refused(tmp_path):
    base = make_tiny_model("gpt2")
    make_adapter(base, 1, r=4, target_modules=["c_attn"]).save_pretrained(tmp_path)
    with EngineCore(base, EngineConfig(block_size=4)) as engine:
        with pytest.raises(ValueError, match="Conv1D; cbgen applies LoRA to linear maps"):
            engine.add_lora("gpt2", str(tmp_path))


def test_slots_names_and_removal(engine, llama_adapters):
    _, folders, _ = llama_adapters
    engine.add_lora("a", folders[0])
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("a", folders[1])
    engine.add_lora("b", folders[1])
    with pytest.raises(ValueError, match="every LoRA slot is in use.*max_loras=2"):
        engine.add_lora("c", folders[2])
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3), request_id="r", lora="b")
    assert [(i.name, i.requests) for i in engine.list_loras()] == [("a", 0), ("b", 1)]
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        engine.remove_lora("b")
    engine.abort("r")
    engine.remove_lora("b")
    engine.add_lora("c", folders[2])  # the freed slot
    assert [i.name for i in engine.list_loras()] == ["a", "c"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
        engine.remove_lora("b")


def test_update_lora_checks_names_and_shapes(engine, llama_adapters):
    _, folders, models = llama_adapters
    engine.add_lora("a", folders[1])  # rank 4
    with pytest.raises(ValueError, match="shapes"):
        engine.update_lora("a", peft.get_peft_model_state_dict(models[0]))  # rank 8
    with pytest.raises(ValueError, match="no lora_B"):
        engine.update_lora(
            "a",
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
        )


def test_lora_off_says_so():
    with EngineCore(make_tiny_model("llama"), EngineConfig(block_size=4, max_loras=0)) as engine:
        with pytest.raises(ValueError, match="max_loras=0"):
            engine.add_lora("a", "/nonexistent")


# -- bfloat16 and quantized bases ---------------------------------------------------------


def _prompt_logprobs(model, prompt, adapter=None) -> torch.Tensor:
    """Each prompt token's logprob under a cbgen engine on ``model`` (with ``adapter``)."""
    with EngineCore(model, EngineConfig(block_size=4)) as engine:
        if adapter is not None:
            engine.add_lora("a", adapter)
        params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
        engine.add_request(prompt, params, request_id="r", lora="a" if adapter else None)
        out = run_until_done(engine)["r"]
    return torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])


def _reference_logprobs(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return torch.tensor([logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))])


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "int4"])
def test_adapters_on_reduced_precision_bases(mode):
    """The adapter's delta lands on the bfloat16 and quantized paths (the fast decoder):
    its logprobs are as far from the float32 peft model's as the base's own rounding
    moves the base, and far from the base's."""
    from cbgen.executor.cpu.model_quantization import quantize_model

    base = make_tiny_model("llama")
    adapter = make_adapter(base, 5, r=8, lora_alpha=16, target_modules="all-linear")
    reduced = copy.deepcopy(base)
    if mode == "bfloat16":
        reduced = reduced.to(torch.bfloat16)
    else:
        quantize_model(reduced, mode)
    for prompt in random_prompts(2, 20, 30, seed=3):
        want = _reference_logprobs(adapter, prompt)
        got = _prompt_logprobs(copy.deepcopy(reduced), prompt, adapter)
        base_got = _prompt_logprobs(copy.deepcopy(reduced), prompt)
        rounding = (base_got - _reference_logprobs(base, prompt)).abs().mean().item()
        error = (got - want).abs().mean().item()
        assert error <= 1.5 * rounding + 0.02
        assert error < 0.5 * (base_got - want).abs().mean().item()
