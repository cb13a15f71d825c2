"""Bad input gets a clear ValueError naming the request and leaves the engine working."""

from __future__ import annotations

import pytest
from conftest import random_prompts, reference_greedy, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams

BAD_PARAMS = [
    (SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SamplingParams(max_new_tokens=-3), "max_new_tokens"),
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(eos_token_ids=[-4]), "eos_token_ids"),
    (SamplingParams(temperature=1.0, top_k=2**63), "top_k"),  # overflowed the batched sampler
    (SamplingParams(temperature=1.0, top_k=257), "top_k"),  # past the vocabulary (256)
    (SamplingParams(temperature=1.0, seed=2**64), "seed"),
    (SamplingParams(temperature=1.0, seed=-1), "seed"),
]


@pytest.mark.parametrize(("params", "field"), BAD_PARAMS)
def test_invalid_sampling_values_are_rejected(llama, params, field):
    with EngineCore(llama, EngineConfig(num_blocks=16)) as engine:
        with pytest.raises(ValueError, match=rf"request 'bad'.*{field}"):
            engine.add_request([5, 6, 7], params, request_id="bad")
        assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "empty"),
        ([5, 256, 7], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
        ([5, "x"], "must be ints"),
        ([7] * 600, "context limit"),
    ],
)
def test_invalid_prompts_are_rejected(llama, prompt, message):
    with EngineCore(llama, EngineConfig(num_blocks=64, block_size=16)) as engine:
        with pytest.raises(ValueError, match=rf"request 'r1'.*{message}"):
            engine.add_request(prompt, request_id="r1")


def test_prompt_longer_than_cache_is_rejected(llama):
    with EngineCore(llama, EngineConfig(num_blocks=4, block_size=4)) as engine:
        assert engine.max_model_len == 16
        with pytest.raises(ValueError, match="context limit is 16"):
            engine.add_request(list(range(3, 19)))


def test_bad_request_leaves_the_others_untouched(llama):
    prompts = random_prompts(4, 5, 20, seed=11)
    expected = [reference_greedy(llama, p, 12) for p in prompts]
    with EngineCore(llama, EngineConfig(num_blocks=64, block_size=8)) as engine:
        for i, p in enumerate(prompts[:2]):
            engine.add_request(p, SamplingParams(max_new_tokens=12), request_id=str(i))
        engine.step()
        with pytest.raises(ValueError):
            engine.add_request([1, 999], request_id="oops")
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([3], request_id="0")
        for i, p in enumerate(prompts[2:], start=2):
            engine.add_request(p, SamplingParams(max_new_tokens=12), request_id=str(i))
        results = {rid: out.token_ids for rid, out in run_until_done(engine).items()}
        assert engine.allocator.num_free == 64
    assert [results[str(i)] for i in range(4)] == expected


def test_generate_batch_raises_naming_every_bad_request(llama):
    with pytest.raises(ValueError) as info:
        cbgen.generate_batch(llama, [[5, 6], [], [7, 1000]], SamplingParams(max_new_tokens=2))
    message = str(info.value)
    assert "request '1'" in message and "request '2'" in message and "request '0'" not in message
    assert llama.config._attn_implementation != "cbgen_paged"


def test_generate_batch_can_skip_bad_requests(llama):
    prompts = [[5, 6, 9], [], [7, 1000], [8, 8, 8, 8]]
    outputs = cbgen.generate_batch(
        llama, prompts, SamplingParams(max_new_tokens=6), raise_on_invalid=False
    )
    assert [o.finish_reason for o in outputs][1:3] == ["error", "error"]
    assert "empty" in outputs[1].error
    assert outputs[0].token_ids == reference_greedy(llama, prompts[0], 6)
    assert outputs[3].token_ids == reference_greedy(llama, prompts[3], 6)


def test_abort_returns_blocks_and_others_finish(llama):
    prompts = random_prompts(3, 20, 30, seed=12)
    with EngineCore(llama, EngineConfig(num_blocks=32, block_size=8)) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=40), request_id=str(i))
        engine.step()
        engine.step()
        assert engine.abort("1")
        assert not engine.abort("1")
        assert not engine.abort("never-added")
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == {"0", "2"}
        assert engine.allocator.num_free == 32


def test_close_aborts_abandoned_requests(llama):
    engine = EngineCore(llama, EngineConfig(num_blocks=32, block_size=8))
    engine.add_request([5] * 30, SamplingParams(max_new_tokens=50))
    engine.step()
    engine.close()
    assert engine.allocator.num_free == 32
    assert not engine.has_unfinished()
    assert llama.config._attn_implementation != "cbgen_paged"


def test_engine_config_rejects_nonsense():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EngineConfig(max_batch_tokens=0)


def test_stops_and_finish_reasons(llama):
    prompt = [5, 6, 7, 8]
    free_run = reference_greedy(llama, prompt, 10)
    stop_id = free_run[3]
    with EngineCore(llama, EngineConfig(num_blocks=32, block_size=8)) as engine:
        engine.add_request(prompt, SamplingParams(max_new_tokens=10, eos_token_ids=[stop_id]), "s")
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
    cut = free_run.index(stop_id) + 1
    assert outs[0].token_ids == free_run[:cut]
    assert outs[0].finish_reason == "stop"


def test_context_limit_finishes_cleanly(llama):
    with EngineCore(llama, EngineConfig(num_blocks=4, block_size=4)) as engine:
        engine.add_request([5] * 10, SamplingParams(max_new_tokens=100, ignore_eos=True), "c")
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        assert outs[0].finish_reason == "context_limit"
        assert len(outs[0].prompt_token_ids) + len(outs[0].token_ids) == 16
        assert engine.allocator.num_free == 4


def test_tiny_temperature_is_greedy(llama):
    """1e-40 used to underflow the logits to infinities, and every token became id 0."""
    prompt = [5, 6, 7, 8]
    want = reference_greedy(llama, prompt, 8)
    params = SamplingParams(max_new_tokens=8, temperature=1e-40, seed=3)
    outputs = cbgen.generate_batch(llama, [prompt], params)
    assert outputs[0].token_ids == want


def test_non_finite_logits_fail_only_their_row(llama):
    """A row whose logits are NaN (here by a processor) finishes alone with 'error'."""
    prompts = random_prompts(3, 4, 10, seed=5)
    expected = [reference_greedy(llama, p, 6) for p in prompts]

    def poison(token_ids, logits):
        if len(token_ids) > len(prompts[1]) + 1:
            logits[3] = float("nan")
        return logits

    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_new_tokens=6) for _ in prompts]
        params[1] = SamplingParams(
            max_new_tokens=6, temperature=temperature, top_k=5, logits_processors=[poison]
        )
        with EngineCore(llama, EngineConfig(num_blocks=32, block_size=8)) as engine:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(p, sp, request_id=str(i))
            results = run_until_done(engine)
            assert engine.allocator.num_free == 32
        assert results["1"].finish_reason == "error" and "non-finite" in results["1"].error
        assert len(results["1"].token_ids) == 2
        assert [results[str(i)].token_ids for i in (0, 2)] == [expected[0], expected[2]]


def test_sample_seeds_wrap_into_the_seed_range(llama):
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2**64 - 1, n=3)
    (out,) = cbgen.generate_batch(llama, [[5, 6, 7]], params)
    assert len(out.completions) == 3


def test_generate_batch_on_an_open_engine_equals_a_fresh_one_and_keeps_it_open(llama):
    prompts = random_prompts(3, 4, 12, seed=7)
    params = SamplingParams(max_new_tokens=5)
    fresh = cbgen.generate_batch(llama, prompts, params)
    assert [o.token_ids for o in fresh] == [reference_greedy(llama, p, 5) for p in prompts]
    with EngineCore(llama) as engine:
        again = cbgen.generate_batch(engine, prompts, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in fresh]
        twice = cbgen.generate_batch(engine, prompts, params)  # still open, nothing left over
        assert [o.token_ids for o in twice] == [o.token_ids for o in fresh]
        with pytest.raises(ValueError, match="engine's own config and tokenizer"):
            cbgen.generate_batch(engine, prompts, params, EngineConfig())
        engine.add_request(prompts[0], params)
        with pytest.raises(ValueError, match="no unfinished requests"):
            cbgen.generate_batch(engine, prompts, params)
