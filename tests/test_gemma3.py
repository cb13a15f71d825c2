"""The bundled Gemma 3 270M: hybrid cache groups and greedy output exact across the window."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import reference_greedy

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.groups import AttentionKind

SENTENCES = [
    "The river bends twice before it reaches the old stone bridge at the edge of town.",
    "In 1869 the first transcontinental railroad in the United States was completed.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "She opened the notebook and found a map drawn in faded blue ink.",
    "A prime number has exactly two divisors: one and itself.",
    "def add(a, b):\n    return a + b\n",
    "The committee will meet again on Thursday to review the budget proposal.",
    "Glaciers carve valleys slowly, grinding rock into fine silt over centuries.",
    "Bread rises because yeast ferments sugars and releases carbon dioxide.",
    "The orchestra tuned to a single A before the conductor raised her baton.",
    "Error: connection timed out after 30 seconds (retrying in 5s).",
    "Octopuses have three hearts and blue blood rich in copper.",
    "He counted the steps to the lighthouse: one hundred and twelve.",
    "Paris, the capital of France, sits on the Seine.",
    "Water boils at a lower temperature on a mountain because the air pressure is lower.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
]


def _prompt(tokenizer, length: int, seed: int) -> list[int]:
    """Real text, cut to exactly ``length`` tokens (BOS first)."""
    rng = random.Random(seed)
    ids = tokenizer("Notes:")["input_ids"]
    while len(ids) < length:
        ids += tokenizer(" " + rng.choice(SENTENCES), add_special_tokens=False)["input_ids"]
    return ids[:length]


@contextmanager
def _window(model, window: int) -> Iterator[None]:
    """Shrink the model's sliding window (config and attention modules), then restore it."""
    config = model.config
    old = config.sliding_window
    modules = [m for m in model.modules() if getattr(m, "sliding_window", None) == old]
    config.sliding_window = window
    for module in modules:
        module.sliding_window = window
    try:
        yield
    finally:
        config.sliding_window = old
        for module in modules:
            module.sliding_window = old


def _run(model, prompts, max_new_tokens, config, window):
    """Greedy outputs in prompt order, the most blocks a decoding request held in one window
    group, and the number of preemptions."""
    bound = -(-window // config.block_size) + 1
    peak = 0
    results = {}
    with EngineCore(model, config) as engine:
        windowed = [g.index for g in engine.cache_groups if g.is_windowed]
        build = engine.executor.batch_builder.build

        def build_and_check(scheduled):  # the blocks held while the step runs
            nonlocal peak
            for chunk in scheduled.scheduled:
                if chunk.num_tokens != 1:
                    continue  # the bound is for decoding requests
                tables = engine.scheduler.block_tables(engine._requests[chunk.request_id])
                for index in windowed:
                    held = sum(b >= 0 for b in tables[index])
                    assert held <= bound
                    peak = max(peak, held)
            return build(scheduled)

        engine.executor.batch_builder.build = build_and_check
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), str(i))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
        assert engine.allocator.num_free == engine.allocator.num_blocks
        preemptions = engine.stats["preemptions"]
    return [results[str(i)] for i in range(len(prompts))], peak, preemptions


def test_gemma3_cache_groups_come_from_the_model(gemma3):
    model, _ = gemma3
    with EngineCore(model, EngineConfig(num_blocks=64)) as engine:
        layers = engine.executor.runner.probe.layers
        assert len(layers) == 18
        assert {(s.num_kv_heads, s.key_dim, s.value_dim) for s in layers} == {(1, 256, 256)}
        windows = [s.sliding_window for s in layers]
        assert windows == [None if i % 6 == 5 else 512 for i in range(18)]
        groups = engine.cache_groups
        assert [(g.kind, g.window, g.layers) for g in groups] == [
            (AttentionKind.FULL, None, (5, 11, 17)),
            (AttentionKind.SLIDING_WINDOW, 512, (0, 1, 2)),
            (AttentionKind.SLIDING_WINDOW, 512, (3, 4, 6)),
            (AttentionKind.SLIDING_WINDOW, 512, (7, 8, 9)),
            (AttentionKind.SLIDING_WINDOW, 512, (10, 12, 13)),
            (AttentionKind.SLIDING_WINDOW, 512, (14, 15, 16)),
        ]
        # Three physical K/V tensors shared by the six groups: 3 layers' K/V per block.
        assert len(engine.executor.cache.tensor_specs) == 3
        assert engine.executor.cache.bytes_per_block == 3 * 1 * (256 + 256) * 4 * 16
        assert not engine.prefix_caching


def test_gemma3_small_window_every_path(gemma3):
    """Real weights with the window cut to 32: chunked prefill, decode and preemption cross it."""
    model, tokenizer = gemma3
    prompts = [_prompt(tokenizer, n, seed) for seed, n in enumerate([12, 45, 70])]
    with _window(model, 32):
        expected = [reference_greedy(model, p, 20) for p in prompts]
        config = EngineConfig(block_size=8, num_blocks=256, max_batch_tokens=24)
        outputs, peak, _ = _run(model, prompts, 20, config, 32)
        assert outputs == expected
        assert peak == -(-32 // 8) + 1
        # Room for one request at its peak (12 full + 5 x 8 windowed blocks) but not for
        # all three: preempted requests are recomputed past the window.
        small = EngineConfig(block_size=8, num_blocks=70, max_batch_tokens=24)
        outputs, _, preemptions = _run(model, prompts, 20, small, 32)
        assert outputs == expected
        assert preemptions > 0


def test_gemma3_crosses_the_512_window(gemma3):
    """The real window: a 500-token prompt whose generation passes position 512."""
    model, tokenizer = gemma3
    prompt = _prompt(tokenizer, 500, seed=7)
    expected = reference_greedy(model, prompt, 20)
    outputs, peak, _ = _run(
        model, [prompt], 20, EngineConfig(block_size=16, max_batch_tokens=128), 512
    )
    assert outputs == [expected]
    assert peak <= 33


@pytest.mark.slow
def test_gemma3_eight_prompts_across_the_512_window(gemma3):
    model, tokenizer = gemma3
    lengths = [470, 488, 499, 505, 511, 512, 530, 560]
    prompts = [_prompt(tokenizer, n, seed) for seed, n in enumerate(lengths)]
    expected = [reference_greedy(model, p, 48) for p in prompts]
    config = EngineConfig(block_size=16, max_batch_tokens=256)
    outputs, peak, _ = _run(model, prompts, 48, config, 512)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {i} ({lengths[i]} tokens) diverged"
    assert peak == 512 // 16 + 1  # ceil(512 / 16) + 1 blocks per window group
