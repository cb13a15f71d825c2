"""Weights that change under an open engine (RL): every token after ``refresh``,
``update_weights``, ``resume`` or an unannounced in-place change comes from the new
weights, and training the model between generations works (``cbgen.core.weights``)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import (
    ARCHITECTURES,
    make_tiny_model,
    random_prompts,
    reference_greedy,
    run_until_done,
)

from cbgen import Engine, EngineConfig, EngineCore, SamplingParams, SpeculativeConfig
from cbgen.executor.cpu.model_quantization import quantize_model

MAX_NEW = 12
CONFIG = dict(block_size=4, num_blocks=96, max_batch_tokens=64)


def _generate(engine, prompts, max_new=MAX_NEW):
    params = SamplingParams(max_new_tokens=max_new)
    ids = [engine.add_request(p, params) for p in prompts]
    results = run_until_done(engine)
    return [results[i].token_ids for i in ids]


def _train_step(model, prompts, lr=0.5):
    """One SGD step on the prompts' language-modelling loss (a backward pass through
    the model right after generating with it)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def _all_blocks_back(engine):
    assert engine.allocator.num_free == engine.allocator.num_blocks
    engine.allocator.check_invariants()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_after_training_and_resume_generation_follows_the_new_weights(arch):
    model = make_tiny_model(arch)
    prompts = random_prompts(3, 4, 12, seed=1)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        first = _generate(engine, prompts)
        engine.pause()
        assert first == [reference_greedy(model, p, MAX_NEW) for p in prompts]
        _train_step(model, prompts)
        expected = [reference_greedy(model, p, MAX_NEW) for p in prompts]
        assert expected != first, "the step was meant to change the outputs"
        engine.resume()
        assert _generate(engine, prompts) == expected
        _all_blocks_back(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_refresh_after_an_in_place_update_generates_from_the_new_weights(arch):
    """An optimizer-like update made while the engine is open (no pause), then
    ``refresh()``: greedy output equals ``model.generate()`` with the new weights."""
    model = make_tiny_model(arch)
    prompts = random_prompts(3, 4, 12, seed=12)
    generator = torch.Generator().manual_seed(0)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        first = _generate(engine, prompts)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
        engine.refresh()
        second = _generate(engine, prompts)
        _all_blocks_back(engine)
    assert second != first
    assert second == [reference_greedy(model, p, MAX_NEW) for p in prompts]


def test_an_unannounced_in_place_change_is_noticed(caplog):
    model = make_tiny_model("llama")
    prompts = random_prompts(3, 4, 12, seed=2)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        first = _generate(engine, prompts)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.3)
        with caplog.at_level(logging.WARNING, logger="cbgen.core.engine_core"):
            second = _generate(engine, prompts)
        assert "weights changed without update_weights() or refresh()" in caplog.text
    assert second != first
    assert second == [reference_greedy(model, p, MAX_NEW) for p in prompts]


def test_update_weights_loads_a_state_dict_and_refreshes():
    model = make_tiny_model("qwen2")
    other = make_tiny_model("qwen2", seed=7)
    prompts = random_prompts(3, 4, 12, seed=3)
    expected = [reference_greedy(other, p, MAX_NEW) for p in prompts]
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        _generate(engine, prompts)  # fills the prefix cache with the old weights' K/V
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="no such parameter"):
            engine.update_weights({"model.nope.weight": torch.zeros(1)})
        bad = {**other.state_dict(), "model.embed_tokens.weight": torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights(bad)
        for name, value in model.state_dict().items():  # nothing was written
            assert torch.equal(value, before[name])
        assert engine.update_weights(other.state_dict().items()) == len(other.state_dict())
        outputs = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        results = run_until_done(engine)
    for request_id, want in zip(outputs, expected, strict=True):
        assert results[request_id].token_ids == want
        assert results[request_id].num_cached_tokens == 0  # the prefix cache was emptied


def test_a_refresh_in_async_mode_hands_out_the_step_in_flight():
    model = make_tiny_model("llama")
    prompts = random_prompts(2, 6, 10, seed=4)
    with EngineCore(model, EngineConfig(**CONFIG, async_scheduling=True)) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
        streamed: dict[str, list[int]] = {i: [] for i in ids}
        final = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                streamed[out.request_id] += out.new_token_ids
                if out.finished:
                    final[out.request_id] = out.token_ids
            steps += 1
            if steps == 4:
                engine.refresh()  # settles the step in flight: its tokens come next step
        _all_blocks_back(engine)
    for request_id in ids:  # no token lost or repeated across the refresh
        assert streamed[request_id] == final[request_id] and len(final[request_id]) == 20


def test_a_refresh_mid_generation_continues_from_the_new_weights():
    model = make_tiny_model("llama")
    prompts = random_prompts(2, 6, 10, seed=4)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
        got: dict[str, list[int]] = {i: [] for i in ids}
        for _ in range(5):
            for out in engine.step():
                got[out.request_id] = out.token_ids
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        engine.refresh()
        final = run_until_done(engine)
        _all_blocks_back(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        tokens = final[request_id].token_ids
        done = len(got[request_id])
        assert tokens[:done] == got[request_id] and 0 < done < 20
        # Everything after the refresh is the new model's continuation of what was there.
        assert tokens[done:] == reference_greedy(model, prompt + tokens[:done], 20 - done)


def test_sleep_frees_the_cache_and_the_packed_weights_and_wake_brings_them_back():
    model = make_tiny_model("llama")
    prompts = random_prompts(2, 4, 12, seed=5)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        first = _generate(engine, prompts)
        engine.add_request(prompts[0], SamplingParams(max_new_tokens=30), "waiting")
        engine.step()
        engine.sleep()
        assert engine.is_paused and not hasattr(engine, "cache")
        assert engine.executor.runner.prepacked_linears == 0
        with pytest.raises(RuntimeError, match="paused"):
            engine.step()
        # The model is the caller's: its own attention, a loss that backpropagates.
        _train_step(model, prompts, lr=0.0)
        engine.wake()
        assert engine.executor.cache is not None and not engine.is_paused
        results = run_until_done(engine)
        assert results["waiting"].token_ids == reference_greedy_off(engine, model, prompts[0], 30)
        assert _generate(engine, prompts) == first
        _all_blocks_back(engine)


def reference_greedy_off(engine, model, prompt, max_new):
    engine.pause()
    try:
        return reference_greedy(model, prompt, max_new)
    finally:
        engine.resume()


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_a_quantized_model_takes_float_weights_and_quantizes_them_again(mode):
    """Also where a fused group's members hold views of its codes (4-bit): the new codes
    go into them in place, and the engine rebuilt from them gives the new model's tokens."""
    model = make_tiny_model("llama")
    update = make_tiny_model("llama", seed=9)
    want_model = copy.deepcopy(update)
    quantize_model(model, mode)
    quantize_model(want_model, mode)
    prompts = random_prompts(2, 4, 12, seed=6)
    with EngineCore(want_model, EngineConfig(**CONFIG)) as engine:
        expected = _generate(engine, prompts)
    with EngineCore(model, EngineConfig(**CONFIG)) as engine:
        before = _generate(engine, prompts)
        engine.update_weights(update.state_dict())
        assert _generate(engine, prompts) == expected != before


def test_a_layer_skip_draft_follows_the_targets_new_weights():
    model = make_tiny_model("llama")
    prompts = [p + p for p in random_prompts(2, 4, 8, seed=8)]
    spec = SpeculativeConfig(method="layer_skip", num_layers=1, adaptive=False)
    with EngineCore(model, EngineConfig(**CONFIG, speculative=spec)) as engine:
        _generate(engine, prompts)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        engine.refresh()
        second = _generate(engine, prompts)
        assert engine.stats["spec_proposed_tokens"] > 0
        engine.pause()
        assert second == [reference_greedy(model, p, MAX_NEW) for p in prompts]


def test_the_online_engine_pauses_trains_and_takes_new_weights():
    """Requests queued while paused wait; the model trains meanwhile; after
    ``update_weights`` and ``resume`` they come from the new weights. A request in
    flight during ``update_weights`` finishes cleanly."""
    model = make_tiny_model("llama")
    other = make_tiny_model("llama", seed=7)
    prompts = random_prompts(3, 4, 12, seed=10)
    with Engine(model, None, EngineConfig(**CONFIG)) as engine:
        running = engine.add_request(prompts[0], SamplingParams(max_new_tokens=200))
        engine.update_weights(other.state_dict())  # between two steps of that request
        assert engine.get_result(running, timeout=120).finish_reason is not None
        engine.pause()
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        _train_step(model, prompts, lr=0.0)  # the model is the caller's while paused
        engine.update_weights(other.state_dict())
        engine.resume()
        results = [engine.get_result(i, timeout=120) for i in ids]
        engine.sleep()
        engine.wake()
        again = engine.get_result(
            engine.add_request(prompts[0], SamplingParams(max_new_tokens=MAX_NEW)), timeout=120
        )
    expected = [reference_greedy(other, p, MAX_NEW) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert again.token_ids == expected[0]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_weight_versions_notice_every_kind_of_change(native):
    """``WeightVersions.changed``, in the native kernels' pass and in Python's: an in-place
    change of a parameter or a buffer, a parameter or buffer replaced or removed in its
    module; nothing else (reading the weights, running the model) counts as a change."""
    from cbgen.core.weights import WeightVersions
    from cbgen.executor.cpu.kernels import decode_kernel

    if native and decode_kernel() is None:
        pytest.skip("native kernels unavailable")
    model = make_tiny_model("llama")
    layer = model.model.layers[0]
    layer.register_buffer("extra", torch.zeros(3))

    def watch():
        versions = WeightVersions(model)
        if native:
            assert versions._watch is not None and len(versions._watch) == len(versions._entries)
        else:
            versions._watch = None
        return versions

    versions = watch()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert not versions.changed()
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(2)
    assert versions.changed()
    versions.mark()
    assert not versions.changed()
    layer.extra.add_(1)
    assert versions.changed()
    versions = watch()
    layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight.detach())
    assert versions.changed()
    versions = watch()
    layer.extra = torch.ones(3)
    assert versions.changed()
    versions = watch()
    del layer._buffers["extra"]
    assert versions.changed()
    versions = watch()
    assert not versions.changed()


def test_weight_versions_of_a_model_off_the_cpu_do_not_build_the_native_kernels(monkeypatch):
    """The native pass is for CPU models only: a model with a tensor elsewhere (the meta
    device stands in for a GPU here) keeps Python's pass and never asks for the kernels."""
    from cbgen.core import weights

    def unexpected():
        raise AssertionError("decode_kernel() was called")

    monkeypatch.setattr(weights, "decode_kernel", unexpected)
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    versions = weights.WeightVersions(model)
    assert versions._watch is None and not versions.changed()
