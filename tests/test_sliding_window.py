"""Sliding-window cache groups: exact output on every path, bounded memory per request."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import make_tiny_model, random_prompts, reference_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.allocator import BlockAllocator
from cbgen.cache.groups import (
    AttentionKind,
    CacheGroup,
    LayerSpec,
    build_groups,
    max_request_tokens,
    tensor_layout,
)
from cbgen.core.scheduler import make_scheduler
from cbgen.requests.request import FinishReason, Request
from cbgen.sampling.params import SamplingParams as Params

WINDOW = 16
# Every layer windowed (Mistral), alternate layers (Gemma 2), three of four (Gemma 3).
WINDOWED = {
    "mistral": dict(arch="mistral-sliding", sliding_window=WINDOW),
    "gemma2": dict(arch="gemma2", sliding_window=WINDOW),
    "gemma3": dict(arch="gemma3"),  # conftest: window 16, layers S S S F
}


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request):
    spec = dict(WINDOWED[request.param])
    model = make_tiny_model(spec.pop("arch"), **spec)
    return request.param, model


def _held(engine: EngineCore, request: Request) -> list[int]:
    """Blocks ``request`` holds in each cache group."""
    return [sum(b >= 0 for b in blocks) for blocks in engine.scheduler.block_tables(request)]


def _run(model, prompts, max_new_tokens, config, check=None):
    """Greedy outputs in prompt order and the stats; ``check(engine, scheduled)`` runs in
    every step between scheduling and the forward pass, while the step's blocks are held."""
    results = {}
    with EngineCore(model, config) as engine:
        if check is not None:
            build = engine.executor.batch_builder.build

            def build_and_check(scheduled):
                check(engine, scheduled)
                return build(scheduled)

            engine.executor.batch_builder.build = build_and_check
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), str(i))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
        assert engine.allocator.num_free == engine.allocator.num_blocks
        engine.allocator.check_invariants()
        stats = dict(engine.stats)
    return [results[str(i)] for i in range(len(prompts))], stats


# -- groups and their arithmetic -----------------------------------------------------------


def test_groups_split_kinds_into_equal_sizes_and_share_tensors():
    full, windowed = LayerSpec(1, 8, 8, torch.float32), LayerSpec(1, 8, 8, torch.float32, 4)
    layers = [windowed] * 5 + [full] + [windowed] * 5 + [full]  # Gemma 3's 5:1 pattern
    groups = build_groups(layers)
    assert [(g.kind, g.layers) for g in groups] == [
        (AttentionKind.FULL, (5, 11)),
        (AttentionKind.SLIDING_WINDOW, (0, 1)),
        (AttentionKind.SLIDING_WINDOW, (2, 3)),
        (AttentionKind.SLIDING_WINDOW, (4, 6)),
        (AttentionKind.SLIDING_WINDOW, (7, 8)),
        (AttentionKind.SLIDING_WINDOW, (9, 10)),
    ]
    tensor_of_layer, tensors = tensor_layout(layers, groups)
    assert len(tensors) == 2  # a block costs two layers' K/V, not twelve
    for group in groups:
        assert sorted(tensor_of_layer[layer] for layer in group.layers) == [0, 1]
    # Layers of different shapes never share.
    odd = [windowed, LayerSpec(2, 8, 8, torch.float32)]
    assert sorted(tensor_layout(odd, build_groups(odd))[0]) == [0, 1]
    # One kind: one group, every layer its own tensor.
    assert build_groups([windowed] * 3) == [
        CacheGroup(0, AttentionKind.SLIDING_WINDOW, (0, 1, 2), 4)
    ]


def test_window_block_arithmetic():
    group = CacheGroup(0, AttentionKind.SLIDING_WINDOW, (0,), window=16)
    # Queries from position 40 on read keys from 25 on: block 6 of 4 tokens.
    assert group.first_needed_block(40, 4) == 6
    assert group.first_needed_block(10, 4) == 0
    # Decoding (chunks of one): at most ceil(15 / 4) + 1 = 5 blocks, never more than needed.
    assert group.max_blocks(1000, 4, 1) == 5 <= -(-WINDOW // 4) + 1
    assert group.max_blocks(6, 4, 1) == 2
    # A chunk of 8 after a full window: ceil((16 + 8 - 2) / 4) + 1 = 7 blocks.
    assert group.max_blocks(1000, 4, 8) == 7
    full = CacheGroup(1, AttentionKind.FULL, (1,))
    assert full.first_needed_block(40, 4) == 0 and full.max_blocks(41, 4, 8) == 11
    # Windowed groups only: any length fits once the window does.
    assert max_request_tokens([group], 7, 4, 8) is None
    assert max_request_tokens([group], 6, 4, 8) == 24
    # With a full group, the window's blocks come off the top.
    assert max_request_tokens([full, group], 20, 4, 8) == (20 - 7) * 4


# -- the scheduler never drops a block a query still reads ---------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=8),
    window=st.sampled_from([1, 3, 8, 13]),
    block_size=st.sampled_from([1, 2, 4]),
    hybrid=st.booleans(),
    extra_blocks=st.integers(0, 30),
    max_batch_tokens=st.integers(1, 24),
)
def test_windowed_scheduler_keeps_exactly_what_queries_read(
    lengths, window, block_size, hybrid, extra_blocks, max_batch_tokens
):
    bs = block_size
    kinds = [None, window] if hybrid else [window]
    groups = [
        CacheGroup(i, AttentionKind.FULL if w is None else AttentionKind.SLIDING_WINDOW, (i,), w)
        for i, w in enumerate(kinds)
    ]
    longest = max(p + n for p, n in lengths)
    fits = max_request_tokens(groups, 10**6, bs, max_batch_tokens)
    need = sum(g.max_blocks(longest, bs, max_batch_tokens) for g in groups)
    assert fits is None or fits >= longest
    allocator = BlockAllocator(need + extra_blocks)
    scheduler = make_scheduler(
        "fifo", allocator, bs, max_batch_tokens, 4, enable_prefix_caching=True, groups=groups
    )
    assert not scheduler.enable_prefix_caching  # never with a window
    requests = [
        Request(str(i), [3 + i] * p, Params(max_new_tokens=n), i)
        for i, (p, n) in enumerate(lengths)
    ]
    for request in requests:
        scheduler.add(request)
    written: dict[tuple[int, int], tuple[str, int]] = {}  # (group, slot) -> (request, position)
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.scheduled
        live = {r.request_id: r for r in scheduler.running}
        for chunk in out.scheduled:
            request, start, end = live[chunk.request_id], chunk.start, chunk.end
            tables = scheduler.block_tables(request)
            assert chunk.block_tables == [t[: -(-end // bs)] for t in tables]
            for group, blocks in zip(groups, tables, strict=True):
                first = 0 if group.window is None else max(0, start - group.window + 1)
                for p in range(first, end):  # every key this chunk reads or writes is held
                    assert blocks[p // bs] >= 0, "a block still read was dropped"
                for p in range(first, start):
                    slot = blocks[p // bs] * bs + p % bs
                    assert written[(group.index, slot)] == (request.request_id, p)
                for p in range(start, end):
                    written[(group.index, blocks[p // bs] * bs + p % bs)] = (request.request_id, p)
                held = sum(b >= 0 for b in blocks)
                assert held <= group.max_blocks(end, bs, chunk.num_tokens)
        holders = Counter(
            b for r in scheduler.running for t in scheduler.block_tables(r) for b in t if b >= 0
        )
        assert all(allocator.ref_count(b) == c for b, c in holders.items())
        assert allocator.num_used == len(holders) == sum(holders.values())
        for chunk in out.scheduled:
            request = live[chunk.request_id]
            if chunk.sample:
                request.token_ids.append(7)
                if request.num_output_tokens >= request.params.max_new_tokens:
                    scheduler.finish(request, FinishReason.LENGTH)
        steps += 1
        assert steps < 3000
    assert allocator.num_free == allocator.num_blocks
    allocator.check_invariants()


# -- exact output on every path ------------------------------------------------------------


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_chunked_prefill_across_the_window(windowed, kernel):
    _, model = windowed
    # Prompts of 20-70 tokens in chunks of at most 12: most chunks start past the window.
    prompts = random_prompts(6, 20, 70, seed=21)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    config = EngineConfig(
        block_size=4, num_blocks=256, max_batch_tokens=12, use_native_kernels=kernel
    )
    outputs, stats = _run(model, prompts, 10, config)
    assert outputs == expected
    assert stats["preemptions"] == 0


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_decode_past_the_window_with_bounded_blocks(windowed, kernel):
    name, model = windowed
    bs = 4
    bound = -(-WINDOW // bs) + 1  # ceil(W / block_size) + 1
    prompts = random_prompts(3, 3, 10, seed=22)
    expected = [reference_greedy(model, p, 60) for p in prompts]
    peak: dict[int, int] = {}

    def check(engine: EngineCore, scheduled) -> None:
        total = sum(sum(_held(engine, r)) for r in engine.scheduler.running)
        assert engine.allocator.num_used == total  # nothing else is held
        for chunk in scheduled.scheduled:
            held = _held(engine, engine._requests[chunk.request_id])
            end = chunk.start + chunk.num_tokens
            for group, count in zip(engine.cache_groups, held, strict=True):
                if not group.is_windowed:
                    assert count == -(-end // bs)
                elif chunk.num_tokens == 1:
                    assert count <= bound, f"{name}: {count} blocks held in a window group"
                    peak[group.index] = max(peak.get(group.index, 0), count)

    config = EngineConfig(
        block_size=bs, num_blocks=256, max_batch_tokens=64, use_native_kernels=kernel
    )
    outputs, _ = _run(model, prompts, 60, config, check)
    assert outputs == expected
    assert peak and max(peak.values()) == bound  # the window is really used, and no more


def test_preemption_past_the_window(windowed):
    name, model = windowed
    prompts = random_prompts(8, 10, 30, seed=23)
    expected = [reference_greedy(model, p, 30) for p in prompts]
    # Room for about two requests at a time: the others are preempted and recomputed.
    with EngineCore(model, EngineConfig(block_size=4, num_blocks=8)) as probe:
        groups = probe.cache_groups
    per_request = sum(g.max_blocks(60, 4, 16) for g in groups)
    config = EngineConfig(block_size=4, num_blocks=per_request * 2, max_batch_tokens=16)
    outputs, stats = _run(model, prompts, 30, config)
    assert outputs == expected
    assert stats["preemptions"] > 0, f"{name}: the cache was meant to be too small"


def test_long_generation_holds_a_window_of_blocks():
    # Every layer windowed: a 200-token generation holds ceil(16 / 8) + 1 = 3 blocks,
    # in a cache of 4 blocks (32 tokens) that could never hold the whole sequence.
    model = make_tiny_model("mistral-sliding", sliding_window=WINDOW)
    prompt = random_prompts(1, 5, 5, seed=24)[0]
    expected = reference_greedy(model, prompt, 200)
    used = []

    def check(engine: EngineCore, scheduled) -> None:
        used.append(engine.allocator.num_used)

    # Chunks of up to 8 tokens need at most ceil((16 + 8 - 2) / 8) + 1 = 4 blocks: any
    # length fits, so only max_model_len limits the request.
    config = EngineConfig(block_size=8, num_blocks=4, max_batch_tokens=8, max_model_len=512)
    with EngineCore(model, config) as engine:
        assert engine.max_model_len == 512
    with EngineCore(model, EngineConfig(block_size=8, num_blocks=4)) as engine:
        assert engine.max_model_len == 32  # chunks of 512 would not fit: the cache bounds it
    outputs, _ = _run(model, [prompt], 200, config, check)
    assert outputs == [expected]
    assert max(used) == 3


def test_prefix_caching_stays_off_for_windowed_groups(windowed):
    name, model = windowed
    with EngineCore(model, EngineConfig(num_blocks=64)) as engine:
        assert not engine.prefix_caching and not engine.scheduler.enable_prefix_caching
        assert any(g.is_windowed for g in engine.cache_groups)
    llama = make_tiny_model("llama")
    with EngineCore(llama, EngineConfig(num_blocks=64)) as engine:
        assert engine.prefix_caching
        assert [g.kind for g in engine.cache_groups] == [AttentionKind.FULL]
