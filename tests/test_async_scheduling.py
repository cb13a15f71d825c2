"""Async scheduling: step N+1 is planned while step N runs (its tokens carried in on the
device). Every output must equal the synchronous loop's, on every path."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from conftest import make_tiny_model, random_prompts, reference_greedy, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.requests.request import FinishReason

BASE = EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=32)


def _run(model, prompts, params, config, abort_at: dict[int, str] | None = None):
    """Final outputs by request id; checks that every block came back."""
    with EngineCore(model, config) as engine:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(p, sp, request_id=str(i))

        def abort(step: int) -> None:
            if abort_at and step in abort_at:
                engine.abort(abort_at[step])

        results = run_until_done(engine, abort)
        engine.allocator.check_invariants()
        assert engine.allocator.num_free == engine.allocator.num_blocks, "blocks leaked"
        if engine.scheduler.host_allocator is not None:
            host = engine.scheduler.host_allocator
            assert host.num_free == host.num_blocks, "swap-space blocks leaked"
        stats = dict(engine.stats)
    return results, stats


def _both(model, prompts, params, config, **kwargs):
    sync, sync_stats = _run(model, prompts, params, config, **kwargs)
    config = dataclasses.replace(config, async_scheduling=True)
    async_, async_stats = _run(model, prompts, params, config, **kwargs)
    assert sorted(sync) == sorted(async_)
    for rid, want in sync.items():
        got = async_[rid]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), rid
    return sync, sync_stats, async_stats


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-sliding"])
def test_async_matches_sync_and_generate(arch):
    model = (
        make_tiny_model(arch)
        if arch != "mistral-sliding"
        else make_tiny_model(arch, sliding_window=16)
    )
    prompts = random_prompts(8, 1, 70, seed=41)
    lengths = [1, 2, 3, 20, 24, 5, 30, 17]  # some end in their first or second step
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    results, _, _ = _both(model, prompts, params, BASE)
    for i, p in enumerate(prompts):
        assert results[str(i)].token_ids == reference_greedy(model, p, lengths[i])


def test_early_stops_drop_the_planned_token(llama):
    prompts = random_prompts(10, 3, 30, seed=42)
    params = [SamplingParams(max_new_tokens=30) for _ in prompts]
    free_run, _ = _run(llama, prompts, params, BASE)
    # Stop ids taken from the outputs themselves, so requests stop mid-run.
    stops = {free_run[str(i)].token_ids[3 + i % 5] for i in range(len(prompts))}
    params = [SamplingParams(max_new_tokens=30, eos_token_ids=tuple(stops)) for _ in prompts]
    results, _, _ = _both(llama, prompts, params, BASE)
    reasons = {r.finish_reason for r in results.values()}
    assert FinishReason.STOP in reasons
    for out in results.values():
        if out.finish_reason is FinishReason.STOP:
            assert out.token_ids[-1] in stops and not set(out.token_ids[:-1]) & stops


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_async(llama, mode):
    prompts = random_prompts(10, 10, 40, seed=4)
    params = [SamplingParams(max_new_tokens=30) for _ in prompts]
    config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=32, preemption_mode=mode)
    results, sync_stats, async_stats = _both(llama, prompts, params, config)
    assert sync_stats["preemptions"] > 0 and async_stats["preemptions"] > 0
    if mode == "swap":
        assert async_stats["swapped_in"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].token_ids == reference_greedy(llama, p, 30)


def test_failed_swap_in_under_async_leaks_nothing(llama):
    prompts = random_prompts(10, 10, 40, seed=4)
    expected = [reference_greedy(llama, p, 30) for p in prompts]
    config = EngineConfig(
        block_size=4,
        num_blocks=24,
        max_batch_tokens=32,
        preemption_mode="swap",
        async_scheduling=True,
    )
    with EngineCore(llama, config) as engine:
        original = engine.executor.swap_space.copy_in
        calls = []

        def flaky(src, dst):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected: host-to-device copy failed")
            return original(src, dst)

        engine.executor.swap_space.copy_in = flaky
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=30), request_id=str(i))
        results = {rid: out.token_ids for rid, out in run_until_done(engine).items()}
        assert engine.stats["swap_failures"] == 1
        assert engine.allocator.num_free == engine.allocator.num_blocks
        host = engine.scheduler.host_allocator
        assert host.num_free == host.num_blocks
    assert [results[str(i)] for i in range(len(prompts))] == expected


def test_shared_prefixes_with_prefix_caching(llama):
    # Prompts whose length is a multiple of the block size put a placeholder at the end
    # of a block: it must never be hashed into the prefix cache.
    shared = random_prompts(1, 16, 16, seed=43)[0]
    prompts = [shared + tail for tail in random_prompts(12, 0, 12, seed=44)]
    prompts += [shared[: 4 * k] for k in (1, 2, 3, 4)]
    params = [SamplingParams(max_new_tokens=12) for _ in prompts]
    config = dataclasses.replace(BASE, max_batch_tokens=24)
    results, stats, async_stats = _both(llama, prompts, params, config)
    assert async_stats["cached_tokens"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].token_ids == reference_greedy(llama, p, 12)


def test_seeded_sampling_and_logits_processors(llama):
    prompts = random_prompts(6, 3, 30, seed=45)

    def no_repeat(token_ids, logits):
        logits[token_ids[-1]] = float("-inf")
        return logits

    params = [
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=i) for i in range(3)
    ] + [SamplingParams(max_new_tokens=16, logits_processors=[no_repeat]) for _ in range(3)]
    _both(llama, prompts, params, BASE)


def test_abort_while_a_step_is_in_flight(llama):
    prompts = random_prompts(6, 3, 30, seed=46)
    params = [SamplingParams(max_new_tokens=20) for _ in prompts]
    results, _, _ = _both(llama, prompts, params, BASE, abort_at={3: "1", 6: "4"})
    assert "1" not in results and "4" not in results  # EngineCore.abort reports nothing
    for i in (0, 2, 3, 5):
        assert results[str(i)].token_ids == reference_greedy(llama, prompts[i], 20)


def test_forward_runs_on_the_worker_and_failures_surface(llama):
    prompts = random_prompts(4, 3, 10, seed=47)
    config = dataclasses.replace(BASE, async_scheduling=True)
    with EngineCore(llama, config) as engine:
        threads = set()
        execute = engine.executor.runner.execute

        def recording(batch):
            threads.add(threading.current_thread().name)
            if engine.stats["decode_tokens"] > 8:
                raise RuntimeError("injected forward failure")
            return execute(batch)

        engine.executor.runner.execute = recording
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=20), request_id=str(i))
        with pytest.raises(RuntimeError, match="injected forward failure"):
            while engine.has_unfinished():
                engine.step()
        assert threads and all(name.startswith("cbgen-forward") for name in threads)
        # The requests whose tokens were in flight are finished (their blocks are back);
        # nothing is left with a placeholder it can never resolve.
        assert all(
            r.pending_index is None for r in engine.scheduler.running + engine.scheduler.waiting
        )
        for i in range(len(prompts)):
            engine.abort(str(i))
        assert not engine.has_unfinished()
        assert engine.allocator.num_free == engine.allocator.num_blocks


def test_online_engine_with_async_scheduling(llama):
    prompts = random_prompts(6, 3, 30, seed=48)
    want = [reference_greedy(llama, p, 16) for p in prompts]
    config = dataclasses.replace(BASE, async_scheduling=True)
    with cbgen.Engine(llama, config=config) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=16)) for p in prompts]
        streamed = [t for d in engine.stream(ids[0]) for t in d.new_token_ids]
        got = [engine.get_result(rid, timeout=60).token_ids for rid in ids[1:]]
        engine.sync()
        assert engine.core.allocator.num_free == engine.core.allocator.num_blocks
    assert [streamed, *got] == want


def test_generate_batch_with_async_scheduling(llama):
    # generate_batch drives the same step loop: the flag reaches it through the config.
    prompts = random_prompts(5, 3, 30, seed=49)
    config = dataclasses.replace(BASE, async_scheduling=True)
    outputs = cbgen.generate_batch(llama, prompts, SamplingParams(max_new_tokens=10), config)
    assert [o.token_ids for o in outputs] == [reference_greedy(llama, p, 10) for p in prompts]
