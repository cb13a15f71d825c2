"""Prefix caching end to end: exact greedy output, cache hits, eviction, n > 1 samples."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import make_tiny_model, random_prompts, reference_greedy

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.prefix_cache import (
    extend_block_hashes,
    hash_block,
    hash_blocks,
    prefix_caching_unsupported_reason,
)


def _shared_prefix_prompts(prefix_len: int, count: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, prefix_len, prefix_len, seed=seed)[0]
    return [prefix + s for s in random_prompts(count, 1, 12, seed=seed + 1)]


def _run(model, prompts, config, max_new_tokens):
    """Drive an EngineCore; return the finished outputs in prompt order and the engine stats."""
    results = {}
    with EngineCore(model, config) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), str(i))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        assert engine.allocator.num_free == engine.allocator.num_blocks
        engine.allocator.check_invariants()
        stats = dict(engine.stats, evictions=engine.allocator.num_evictions)
    return [results[str(i)] for i in range(len(prompts))], stats


def test_block_hash_is_stable_and_chained():
    # A fixed digest: the same in every process and run (Python's hash() is salted).
    assert hash_block(b"", [1, 2, 3, 4]).hex() == "087a24230771ee662be37e5493b333d7"
    first, second = hash_blocks([1, 2, 3, 4, 5], 2)  # the partial tail block has no hash
    assert second == hash_block(first, [3, 4]) != hash_block(b"", [3, 4])
    assert hash_blocks([9, 9, 3, 4], 2)[1] != second, "a block's hash covers its whole prefix"


def test_a_salt_starts_another_chain():
    """A LoRA adapter's requests hash from their own root: equal tokens, other digests,
    for every block (the chain carries the root along)."""
    tokens = list(range(12))
    plain = extend_block_hashes([], tokens, 4, 3)
    assert plain == hash_blocks(tokens, 4)
    salted = extend_block_hashes([], tokens, 4, 3, salt=b"lora:a:1")
    assert not set(salted) & set(plain)
    assert salted == extend_block_hashes([], tokens, 4, 3, salt=b"lora:a:1")
    assert not set(salted) & set(extend_block_hashes([], tokens, 4, 3, salt=b"lora:a:2"))


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("prefix_len", [32, 37])  # ends on a block boundary / mid-block
def test_shared_prefix_outputs_are_exact(llama, policy, prefix_len):
    prompts = _shared_prefix_prompts(prefix_len, 6, seed=prefix_len)
    expected = [reference_greedy(llama, p, 12) for p in prompts]
    outputs = {}
    for caching in (True, False):
        config = EngineConfig(
            block_size=8,
            num_blocks=96,
            max_batch_tokens=24,
            enable_prefix_caching=caching,
            scheduler_policy=policy,
        )
        outputs[caching], stats = _run(llama, prompts, config, 12)
        assert [o.token_ids for o in outputs[caching]] == expected
        if caching:
            full = prefix_len // 8 * 8
            assert outputs[True][0].num_cached_tokens == 0
            assert [o.num_cached_tokens for o in outputs[True][1:]] == [full] * 5
            assert stats["cached_tokens"] == 5 * full
        else:
            assert {o.num_cached_tokens for o in outputs[False]} == {0}
            assert stats["cached_tokens"] == 0
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]


def test_num_cached_tokens_counts_full_blocks_up_to_the_last_prompt_token(llama):
    base = random_prompts(1, 30, 30, seed=40)[0]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64)
    with EngineCore(llama, config) as engine:

        def run(prompt, max_new=12):
            rid = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished and out.request_id == rid:
                        result = out
            return result

        first = run(base)
        assert first.num_cached_tokens == 0
        assert run(base[:20] + [7, 7, 7]).num_cached_tokens == 16  # prefix ends mid-block
        assert run(base).num_cached_tokens == 24  # all cached: the last token is recomputed
        assert run([9] * 30).num_cached_tokens == 0
        # Blocks of generated tokens are cached too: base + its first 10 outputs is 40
        # tokens, of which 32 (not 40: the last token is computed) come from the cache.
        follow = base + first.token_ids[:10]
        again = run(follow, max_new=6)
        assert again.num_cached_tokens == 32
        assert engine.allocator.num_evictable > 0
    assert first.token_ids == reference_greedy(llama, base, 12)
    assert again.token_ids == reference_greedy(llama, follow, 6)


def test_reset_prefix_cache_forgets_every_cached_prefix(llama):
    prompt = random_prompts(1, 30, 30, seed=41)[0]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64)
    with EngineCore(llama, config) as engine:

        def run() -> int:
            rid = engine.add_request(prompt, SamplingParams(max_new_tokens=4))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished and out.request_id == rid:
                        cached = out.num_cached_tokens
            return cached

        assert run() == 0
        assert run() == 24
        engine.reset_prefix_cache()
        assert engine.allocator.num_cached == 0 and engine.allocator.num_evictable == 0
        assert engine.allocator.num_free == engine.allocator.num_blocks
        engine.allocator.check_invariants()
        assert run() == 0  # computed afresh, and cached again for the next one
        assert run() == 24


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_exact_after_eviction_and_preemption(llama, policy):
    # Three prefix families in a cache of 20 blocks x 4 tokens: cached blocks of one
    # family are evicted by the others and recomputed when it comes back.
    families = [_shared_prefix_prompts(24, 3, seed=50 + k) for k in range(3)]
    prompts = [p for round_ in zip(*families, strict=True) for p in round_]
    prompts += families[0]
    expected = [reference_greedy(llama, p, 10) for p in prompts]
    config = EngineConfig(
        block_size=4, num_blocks=20, max_batch_tokens=32, max_num_seqs=3, scheduler_policy=policy
    )
    outputs, stats = _run(llama, prompts, config, 10)
    assert [o.token_ids for o in outputs] == expected
    assert stats["evictions"] > 0, "the cache was meant to be too small to keep everything"
    assert stats["cached_tokens"] > 0


def test_exact_with_priorities(llama):
    prompts = _shared_prefix_prompts(20, 6, seed=60)
    expected = [reference_greedy(llama, p, 8) for p in prompts]
    params = [SamplingParams(max_new_tokens=8, priority=i % 3) for i in range(6)]
    for policy in ("fifo", "prefill_first"):
        config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=16, max_num_seqs=3)
        config.scheduler_policy = policy
        outputs = cbgen.generate_batch(llama, prompts, params, config)
        assert [o.token_ids for o in outputs] == expected


def test_sliding_window_models_turn_caching_off():
    for arch, exact in [("llama", True), ("qwen2", True), ("mistral-sliding", False)]:
        model = make_tiny_model(arch)
        assert (prefix_caching_unsupported_reason(model.config) is None) == exact, arch
        with EngineCore(model, EngineConfig(num_blocks=8)) as engine:
            assert engine.prefix_caching == exact
            assert engine.scheduler.enable_prefix_caching == exact
    gemma2 = make_tiny_model("gemma2")
    assert "sliding window" in prefix_caching_unsupported_reason(gemma2.config)


def test_caching_can_be_turned_off(llama):
    config = EngineConfig(num_blocks=8, enable_prefix_caching=False)
    with EngineCore(llama, config) as engine:
        assert not engine.prefix_caching and not engine.scheduler.enable_prefix_caching
    with pytest.raises(ValueError, match="scheduler_policy"):
        EngineConfig(scheduler_policy="random")


def test_n_samples_share_the_prompt_and_follow_their_seeds(llama):
    prompt = random_prompts(1, 29, 29, seed=70)[0]
    config = EngineConfig(block_size=8, num_blocks=64)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, n=3)
    (out,) = cbgen.generate_batch(llama, [prompt], params, config)
    assert len(out.completions) == 3 and out.request_id == "0"
    assert out.token_ids == out.completions[0].token_ids
    assert out.finish_reason == out.completions[0].finish_reason
    # The later samples reuse the prompt's blocks computed by the first.
    assert [c.num_cached_tokens for c in out.completions] == [0, 24, 24]
    # Sample i is the request seeded with seed + i, whatever ran beside it.
    for i, completion in enumerate(out.completions):
        single = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5 + i)
        (alone,) = cbgen.generate_batch(llama, [prompt], single, config)
        assert alone.token_ids == completion.token_ids
        assert alone.completions[0].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    # Greedy samples are all the reference output.
    (greedy,) = cbgen.generate_batch(llama, [prompt], SamplingParams(max_new_tokens=6, n=2))
    assert [c.token_ids for c in greedy.completions] == [reference_greedy(llama, prompt, 6)] * 2


def test_n_and_priority_are_validated(llama):
    with pytest.raises(ValueError, match=r"request '1'.*n must be"):
        cbgen.generate_batch(llama, [[5, 6], [5, 6]], [SamplingParams(), SamplingParams(n=0)])
    outputs = cbgen.generate_batch(
        llama,
        [[5, 6], [5, 6]],
        [SamplingParams(max_new_tokens=2, n=2), SamplingParams(priority="high")],
        raise_on_invalid=False,
    )
    assert len(outputs[0].completions) == 2 and outputs[1].finish_reason == "error"
    assert "priority" in outputs[1].error
    with EngineCore(llama, EngineConfig(num_blocks=8)) as engine:
        with pytest.raises(ValueError, match="generate_batch"):
            engine.add_request([5, 6], SamplingParams(n=2))
        assert not engine.has_unfinished()


def test_block_hashes_agree_across_processes_whatever_the_hash_seed():
    """Several processes (tensor-parallel ranks, server replicas) must name a block the
    same way: the digests are BLAKE2b, not Python's salted ``hash``."""
    script = (
        "from cbgen.cache.prefix_cache import extend_block_hashes;"
        "print(b''.join(extend_block_hashes([], list(range(100)), 16, 6, b'adapter:1')).hex(),"
        " hash('cbgen'))"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert outputs[0][1] != outputs[1][1]  # Python's own hash did differ
    assert outputs[0][0] == outputs[1][0] and len(outputs[0][0]) == 6 * 32
