"""Preemption by swap: K/V copied to host memory and back gives the same tokens as no
preemption, and a failed copy costs only its own request a recompute, leaking nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, random_prompts, reference_greedy, run_until_done

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.requests.request import RequestStatus

# 10 requests of up to ~70 tokens in a cache of 96 tokens: they cannot all fit.
PROMPTS = random_prompts(10, 10, 40, seed=4)
NEW_TOKENS = 30


def _config(**overrides) -> EngineConfig:
    settings = dict(block_size=4, num_blocks=24, max_batch_tokens=32, preemption_mode="swap")
    settings.update(overrides)
    return EngineConfig(**settings)


def _run(engine: EngineCore, prompts, new_tokens=NEW_TOKENS):
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens), request_id=str(i))
    results = run_until_done(engine)
    return [results[str(i)].token_ids for i in range(len(prompts))]


def _assert_nothing_held(engine: EngineCore) -> None:
    engine.allocator.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks, "device blocks leaked"
    host = engine.scheduler.host_allocator
    host.check_invariants()
    assert host.num_free == host.num_blocks, "swap-space blocks leaked"


@pytest.fixture(scope="module")
def expected(llama):
    return [reference_greedy(llama, p, NEW_TOKENS) for p in PROMPTS]


def test_swap_preemption_matches_generate(llama, expected):
    with EngineCore(llama, _config()) as engine:
        assert _run(engine, PROMPTS) == expected
        stats = engine.stats
        assert stats["swapped_out"] > 0 and stats["swapped_in"] == stats["swapped_out"]
        assert stats["preemptions"] == stats["swapped_out"], "every victim fit the swap space"
        _assert_nothing_held(engine)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_swap_with_prefix_caching_and_shared_prefixes(llama, policy):
    shared = random_prompts(1, 20, 20, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(8, 2, 20, seed=9)]
    want = [reference_greedy(llama, p, 24) for p in prompts]
    config = _config(num_blocks=20, scheduler_policy=policy)
    with EngineCore(llama, config) as engine:
        assert _run(engine, prompts, 24) == want
        assert engine.stats["swapped_out"] > 0
        assert engine.stats["cached_tokens"] > 0
        _assert_nothing_held(engine)


def test_full_swap_space_falls_back_to_recompute(llama, expected):
    # Room for two blocks: most victims hold more, so they are recomputed instead.
    with EngineCore(llama, _config()) as probe:
        block_bytes = probe.executor.cache.bytes_per_block
    with EngineCore(llama, _config(swap_space=2 * block_bytes)) as engine:
        assert engine.scheduler.host_allocator.num_blocks == 2
        assert _run(engine, PROMPTS) == expected
        stats = engine.stats
        assert stats["preemptions"] > stats["swapped_out"], "some victims should recompute"
        _assert_nothing_held(engine)


def test_windowed_model_swaps_only_its_window():
    model = make_tiny_model("gemma3")  # conftest: window 16, layers S S S F
    prompts = random_prompts(8, 10, 30, seed=23)
    want = [reference_greedy(model, p, 30) for p in prompts]
    with EngineCore(model, _config()) as probe:
        groups = probe.cache_groups
    assert len(groups) > 1
    per_request = sum(g.max_blocks(60, 4, 16) for g in groups)  # room for about two at once
    with EngineCore(model, _config(num_blocks=2 * per_request, max_batch_tokens=16)) as engine:
        assert _run(engine, prompts) == want
        assert engine.stats["swapped_out"] > 0
        _assert_nothing_held(engine)


def _corrupt_then_fail(engine: EngineCore, which: str, failures: list[str]):
    """Make the first ``which`` copy scribble over its destination, then raise."""
    swap = engine.executor.swap_space
    original = getattr(swap, which)

    def failing(src, dst):
        if failures:
            return original(src, dst)
        failures.append(which)
        if which == "copy_in":  # half-written device blocks must never be read
            for tensor in engine.executor.cache.block_tensors:
                tensor[:, list(dst)] = float("nan")
        raise RuntimeError("injected: host-to-device copy failed")

    setattr(swap, which, failing)


@pytest.mark.parametrize("which", ["copy_in", "copy_out"])
def test_failed_copy_requeues_only_its_request_and_leaks_nothing(llama, expected, which):
    with EngineCore(llama, _config()) as engine:
        failures: list[str] = []
        _corrupt_then_fail(engine, which, failures)
        assert _run(engine, PROMPTS) == expected, "the failed request recomputes exactly"
        assert failures == [which]
        assert engine.stats["swap_failures"] == 1
        _assert_nothing_held(engine)


def test_aborting_a_swapped_request_frees_its_host_blocks(llama):
    with EngineCore(llama, _config()) as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS), request_id=str(i))
        aborted = None
        while engine.has_unfinished():
            engine.step()
            if aborted is None and engine.scheduler.swapped:
                victim = engine.scheduler.swapped[0]
                host = engine.scheduler.host_allocator
                assert host.num_free < host.num_blocks
                assert engine.request_status(victim.request_id) is RequestStatus.SWAPPED
                assert engine.abort(victim.request_id)
                aborted = victim.request_id
        assert aborted is not None, "a request was meant to be swapped out"
        _assert_nothing_held(engine)


def test_swap_copies_blocks_exactly():
    model = make_tiny_model("llama")
    with EngineCore(model, _config()) as engine:
        swap = engine.executor.swap_space
        for tensor in engine.executor.cache.block_tensors:
            tensor.copy_(torch.randn_like(tensor))
        before = [t.clone() for t in engine.executor.cache.block_tensors]
        swap.copy_out([3, 7], [0, 1])
        for tensor in engine.executor.cache.block_tensors:
            tensor[:, [3, 7]] = 0
        swap.copy_in([1, 0], [5, 2])  # back into other blocks, order swapped
        for old, new in zip(before, engine.executor.cache.block_tensors, strict=True):
            assert torch.equal(new[:, 5], old[:, 7]) and torch.equal(new[:, 2], old[:, 3])


def test_bad_preemption_mode_is_rejected():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1)
