"""Models whose layers keep a per-request state (Mamba, Mamba2, gated delta rule, short
convolutions), alone or beside attention: token-identical to ``generate()`` through
chunked prefill, preemption and async scheduling, every slot back after a run, and the
models cbgen cannot hold refused at construction by name."""

from __future__ import annotations

import logging

import pytest
import torch
from architectures import REFUSED_ARCHITECTURES, STATE_ARCHITECTURES, build_config
from conftest import random_prompts, reference_greedy, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.state import StateSlotPool, state_bytes_per_request
from cbgen.executor.runner import Executor
from cbgen.executor.state_mixers import UnsupportedStateLayer


def _model(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_next():
    return _model("qwen3_next")


@pytest.fixture(scope="module")
def mamba():
    return _model("mamba")


def _run(model, prompts, max_new_tokens, config, after_step=None):
    """Run ``prompts`` on one engine; return the outputs in order and the engine's stats,
    after checking every block and state slot came back."""
    with EngineCore(model, config) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), str(i))
        results = run_until_done(engine, after_step)
        assert engine.allocator.num_free == engine.allocator.num_blocks, "a block leaked"
        slots = engine.scheduler.kv.state_slots
        assert slots is not None and slots.num_free == config.max_num_seqs, "a slot leaked"
        stats = dict(engine.stats)
        mixers = engine.executor.runner.state_mixers
        modules = list(mixers.modules) if mixers is not None else []
    assert all("forward" not in m.__dict__ for m in modules), "a state layer kept cbgen's forward"
    return [results[str(i)] for i in range(len(prompts)) if str(i) in results], stats


@pytest.mark.parametrize("arch", STATE_ARCHITECTURES)
def test_state_models_match_generate_with_chunked_prefill(arch):
    model = _model(arch)
    prompts = random_prompts(6, 1, 40, seed=1)
    expected = [reference_greedy(model, p, 16) for p in prompts]
    # A 16-token budget: long prompts are prefilled in chunks beside running decodes.
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=16)
    outputs, stats = _run(model, prompts, 16, config)
    assert [o.token_ids for o in outputs] == expected
    assert stats["prefill_tokens"] > 0 and stats["decode_tokens"] > 0
    assert model.config._attn_implementation != "cbgen_paged", "engine must restore attention"


@pytest.mark.parametrize("arch", STATE_ARCHITECTURES)
def test_preempted_state_requests_recompute_exactly(arch):
    model = _model(arch)
    prompts = random_prompts(8, 10, 30, seed=4)
    expected = [reference_greedy(model, p, 24) for p in prompts]
    # 20 blocks of 4 tokens: two or three requests fit, the others wait or are preempted.
    config = EngineConfig(block_size=4, num_blocks=20, max_batch_tokens=24, max_num_seqs=6)
    outputs, stats = _run(model, prompts, 24, config)
    assert stats["preemptions"] > 0, "the cache was meant to be too small"
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("arch", STATE_ARCHITECTURES)
def test_async_scheduling_keeps_state_models_exact(arch):
    model = _model(arch)
    prompts = random_prompts(6, 1, 30, seed=7)
    expected = [reference_greedy(model, p, 12) for p in prompts]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=12, async_scheduling=True)
    outputs, _ = _run(model, prompts, 12, config)
    assert [o.token_ids for o in outputs] == expected


def test_requests_arriving_and_aborted_mid_run_keep_the_rest_exact(qwen3_next):
    prompts = random_prompts(6, 3, 25, seed=9)
    expected = [reference_greedy(qwen3_next, p, 14) for p in prompts]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=20, max_num_seqs=4)
    with EngineCore(qwen3_next, config) as engine:
        for i in range(3):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=14), str(i))

        def arrive(step):
            if step == 2:
                engine.abort("1")  # its slot goes back and is handed to a newcomer
                for i in range(3, 6):
                    engine.add_request(prompts[i], SamplingParams(max_new_tokens=14), str(i))

        results = run_until_done(engine, arrive)
        assert engine.scheduler.kv.state_slots.num_free == 4
        assert engine.allocator.num_free == 64
    assert "1" not in results  # aborted: it never finishes through a step
    for i in (0, 2, 3, 4, 5):
        assert results[str(i)].token_ids == expected[i], i


@pytest.mark.parametrize("arch", STATE_ARCHITECTURES)
def test_prefix_cache_hits_start_from_a_state_checkpoint(arch):
    """Requests repeating a prompt (GRPO's samples, a re-asked question) take its cached
    blocks and the state saved after the last of them, then compute the rest: exactly
    ``generate()``'s tokens."""
    model = _model(arch)
    first, second = random_prompts(2, 17, 24, seed=12)
    prompts = [first] * 3 + [second] * 3 + [first[:16] + [9]]
    expected = [reference_greedy(model, p, 10) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=64, max_num_seqs=2)
    outputs, stats = _run(model, prompts, 10, config)
    assert [o.token_ids for o in outputs] == expected
    repeats = [o.num_cached_tokens for o in outputs[1:3] + outputs[4:6]]
    assert all(cached >= 16 for cached in repeats), repeats
    # A prompt sharing 16 tokens (4 blocks) but no checkpoint there computes in full.
    assert outputs[6].num_cached_tokens == 0


def test_prefix_cache_hits_of_a_chunked_prompt_and_after_preemption(qwen3_next, mamba):
    # Checkpoints at each chunk's last prompt block, a cache small enough to preempt and
    # evict, async scheduling: hits start wherever a checkpoint and its blocks survive.
    for model in (qwen3_next, mamba):
        shared = random_prompts(1, 30, 30, seed=14)[0]
        prompts = [shared + tail for tail in random_prompts(8, 2, 12, seed=15)]
        expected = [reference_greedy(model, p, 14) for p in prompts]
        config = EngineConfig(
            block_size=4,
            num_blocks=40,
            max_batch_tokens=12,
            max_num_seqs=3,
            async_scheduling=True,
        )
        outputs, stats = _run(model, prompts, 14, config)
        assert [o.token_ids for o in outputs] == expected
        assert stats["cached_tokens"] > 0


def test_swap_falls_back_to_recompute_with_a_reason(qwen3_next, caplog):
    prompts = random_prompts(6, 10, 25, seed=16)
    expected = [reference_greedy(qwen3_next, p, 12) for p in prompts]
    config = EngineConfig(
        block_size=4, num_blocks=24, max_batch_tokens=32, preemption_mode="swap", max_num_seqs=6
    )
    with caplog.at_level(logging.INFO, logger="cbgen"):
        outputs, stats = _run(qwen3_next, prompts, 12, config)
    assert [o.token_ids for o in outputs] == expected
    assert stats["preemptions"] > 0 and stats["swapped_out"] == 0
    assert "preemption recomputes" in caplog.text


def test_speculative_decoding_is_refused_for_state_models(qwen3_next):
    config = EngineConfig(speculative=cbgen.SpeculativeConfig(num_tokens=3))
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        EngineCore(qwen3_next, config)
    assert qwen3_next.config._attn_implementation != "cbgen_paged"


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHITECTURES))
def test_models_keeping_state_cbgen_cannot_hold_are_refused_by_name(arch):
    model = _model(arch)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedStateLayer, match=REFUSED_ARCHITECTURES[arch]) as raised:
        EngineCore(model, EngineConfig(num_blocks=16))
    assert "cannot run exactly" in str(raised.value)
    # Nothing of the engine is left on the model: it generates as before.
    assert model.config._attn_implementation == before
    assert not any("forward" in m.__dict__ for m in model.modules())
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_a_failed_construction_raises_its_own_error(monkeypatch, llama):
    """The error that stopped the executor's construction is the one raised, not a second
    one from cleaning up."""

    def broken_probe(self):
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(Executor, "_probe", broken_probe)
    with pytest.raises(RuntimeError, match="the probe broke"):
        Executor(llama)
    assert llama.config._attn_implementation != "cbgen_paged"


def test_mamba_continues_chunks_a_token_at_a_time_and_mamba2_whole():
    # Mamba's torch scan ignores the state it is handed when given several tokens;
    # Mamba2's chunked scan takes it. The probe finds out by running each.
    for arch, whole in (("mamba", False), ("jamba", False), ("mamba2", True), ("qwen3_next", True)):
        executor = Executor(_model(arch))
        try:
            assert executor.state_mixers is not None
            assert executor.state_mixers.chunks_continue == [whole] * len(executor.state_mixers)
            specs = executor.probe.state_layers
            assert specs and all(s.bytes_per_request > 0 for s in specs)
        finally:
            executor.close()


def test_state_layers_are_described_in_bytes(qwen3_next):
    with EngineCore(qwen3_next, EngineConfig(num_blocks=16, max_num_seqs=3)) as engine:
        specs = engine.state_specs
        assert [s.layer_idx for s in specs] == [0, 1, 2]  # layer 3 is full attention
        kinds = {t.kind for s in specs for t in s.tensors}
        assert kinds == {"conv", "recurrent"}
        assert engine.executor.state_cache is not None
        # One slot per max_num_seqs, and as many prefix-cache checkpoints.
        assert engine.executor.state_cache.tensors[0][0].shape[0] == 6
    config = EngineConfig(num_blocks=16, max_num_seqs=3, enable_prefix_caching=False)
    with EngineCore(qwen3_next, config) as engine:
        assert engine.executor.state_cache.tensors[0][0].shape[0] == 3
        assert "conv[0]" in specs[0].describe()


def test_state_slot_pool_hands_out_each_slot_once():
    pool = StateSlotPool(3)
    taken = [pool.allocate() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate()
    pool.free(taken[1])
    with pytest.raises(ValueError, match="not in use"):
        pool.free(taken[1])
    with pytest.raises(ValueError, match="not in use"):
        pool.free(7)
    assert pool.allocate() == taken[1]


def test_generate_batch_on_a_pure_state_model(mamba):
    prompts = random_prompts(5, 1, 20, seed=3)
    expected = [reference_greedy(mamba, p, 10) for p in prompts]
    outputs = cbgen.generate_batch(mamba, prompts, SamplingParams(max_new_tokens=10))
    assert [o.token_ids for o in outputs] == expected


def test_a_state_layer_cbgen_does_not_recognize_is_refused_by_the_config(monkeypatch, qwen3_next):
    """If a model's state layers kept their state in a way cbgen does not see (here: the
    detection is blinded), its config's ``layer_types`` still names them: refused."""
    from cbgen.executor import state_mixers

    monkeypatch.setattr(state_mixers, "_state_usage", lambda cls: (None, None))
    with pytest.raises(UnsupportedStateLayer, match="declares 3 layers that keep a per-request"):
        EngineCore(qwen3_next, EngineConfig(num_blocks=16))
    assert qwen3_next.config._attn_implementation != "cbgen_paged"


def test_a_state_model_as_draft_is_refused(llama, mamba):
    config = EngineConfig(
        num_blocks=32, speculative=cbgen.SpeculativeConfig(method="draft", draft_model=mamba)
    )
    with pytest.raises(ValueError, match="a draft must keep K/V only"):
        EngineCore(llama, config)
    assert llama.config._attn_implementation != "cbgen_paged"
    assert mamba.config._attn_implementation != "cbgen_paged"
    assert not any("forward" in m.__dict__ for m in mamba.modules())


def test_consecutive_slots_are_read_in_place_others_gathered():
    from cbgen.executor.metadata import SlotSet

    cpu = torch.device("cpu")
    assert SlotSet.of([3, 4, 5], cpu).first == 3
    assert SlotSet.of([7], cpu).first == 7
    assert SlotSet.of([4, 3], cpu).first is None
    assert SlotSet.of([0, 2], cpu).first is None
    assert SlotSet.of([0, 2], cpu).ids.tolist() == [0, 2] and len(SlotSet.of([0, 2], cpu)) == 2


@pytest.mark.parametrize("arch", STATE_ARCHITECTURES)
def test_bfloat16_state_models_are_accepted_with_the_same_chunk_decisions(arch):
    """The probe's checks allow bfloat16's rounding (up to about 1% of what the state is
    worth) and still catch a state that is ignored (10% of it and more)."""
    decisions = {}
    for dtype in (torch.float32, torch.bfloat16):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_config(arch), dtype=dtype).eval()
        executor = Executor(model)
        try:
            assert executor.state_mixers is not None
            decisions[dtype] = list(executor.state_mixers.chunks_continue)
        finally:
            executor.close()
    assert decisions[torch.bfloat16] == decisions[torch.float32]


def test_the_state_slots_come_out_of_the_cache_budget_first(qwen3_next):
    with EngineCore(qwen3_next, EngineConfig(num_blocks=16, max_num_seqs=4)) as engine:
        per_request = state_bytes_per_request(engine.state_specs)
        per_block = engine.executor.cache.bytes_per_block
    # Four running requests' slots and four checkpoints, then the blocks.
    budget = 8 * per_request + 10 * per_block
    with EngineCore(qwen3_next, EngineConfig(kv_cache_memory=budget, max_num_seqs=4)) as engine:
        assert engine.allocator.num_blocks == 10
    with pytest.raises(ValueError, match="holds no block after .* bytes of state slots"):
        EngineCore(qwen3_next, EngineConfig(kv_cache_memory=8 * per_request, max_num_seqs=4))


def test_a_refresh_mid_run_recomputes_the_states(qwen3_next):
    """RL's weight refresh rebuilds the executor (the state layers are swapped again) and
    recomputes every request: the outputs stay those of ``generate()``."""
    prompts = random_prompts(4, 5, 25, seed=11)
    expected = [reference_greedy(qwen3_next, p, 12) for p in prompts]
    with EngineCore(qwen3_next, EngineConfig(num_blocks=64, max_batch_tokens=16)) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_new_tokens=12), str(i))

        def refresh(step):
            if step == 4:
                engine.refresh()

        results = run_until_done(engine, refresh)
        assert engine.scheduler.kv.state_slots.num_free == engine.config.max_num_seqs
    assert [results[str(i)].token_ids for i in range(4)] == expected
