"""Token-count scheduling: a request given 1 + k tokens (k proposed ones to verify), of
which the output processor accepts 0..k+1, and the K/V of rejected ones rolled back.

The tests act as the proposer: between steps they write each running request's
``draft_token_ids`` (right ones, wrong ones, or a mix), and greedy output must stay
token-identical to ``model.generate()`` whatever was proposed.
"""

from __future__ import annotations

import random

import pytest
from conftest import make_tiny_model, random_prompts, reference_greedy

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.allocator import BlockAllocator
from cbgen.core.output_processor import OutputProcessor
from cbgen.core.scheduler import Scheduler
from cbgen.requests.request import Request


def test_a_request_given_1_plus_k_tokens_rolls_back_the_rejected_ones_exactly():
    bs = 4
    allocator = BlockAllocator(16)
    scheduler = Scheduler(allocator, bs, max_batch_tokens=64, max_num_seqs=4)
    processor = OutputProcessor(set(), 1 << 20)
    request = Request("a", [3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=20), 0)
    scheduler.add(request)
    live = {"a": request}
    out = scheduler.schedule()
    processor.resolve(processor.advance(out, live), [9])  # prompt done, token 9 sampled
    scheduler.update_from_output([request])  # the step settles
    assert request.token_ids[-1] == 9 and request.num_computed_tokens == 6

    request.draft_token_ids = [10, 11, 12, 13]  # k = 4
    out = scheduler.schedule()
    (chunk,) = out.scheduled
    assert (chunk.start, chunk.token_ids, chunk.num_drafts) == (6, [9, 10, 11, 12, 13], 4)
    assert chunk.num_sampled == 5
    assert request.num_computed_tokens == 11
    assert len(scheduler.block_tables(request)[0]) == 3  # 11 positions in blocks of 4
    # The target samples 10, 11, then 20 where 12 was proposed: j = 2 drafts (12, 13)
    # are rejected, 10 and 11 accepted and 20 added after them.
    outputs, _ = processor.resolve(processor.advance(out, live), [10, 11, 20, 0, 0])
    scheduler.update_from_output([request])  # the step settles
    assert outputs[0].new_token_ids == [10, 11, 20]
    assert request.token_ids == [3, 4, 5, 6, 7, 8, 9, 10, 11, 20]

    request.draft_token_ids = []
    out = scheduler.schedule()
    # Positions 9 and 10 held the rejected 12 and 13: they are recomputed from 9 on,
    # and block 2 (positions 8..11) is kept for the K/V of 11 at position 8.
    (chunk,) = out.scheduled
    assert (chunk.start, chunk.token_ids) == (9, [20])
    assert len(scheduler.block_tables(request)[0]) == 3
    assert allocator.num_free == 16 - 3
    allocator.check_invariants()

    request.draft_token_ids = [30, 31, 32, 33, 34, 35]  # into a fourth block, all wrong
    processor.resolve(processor.advance(out, live), [21])
    scheduler.update_from_output([request])  # the step settles
    out = scheduler.schedule()
    assert out.scheduled[0].num_tokens == 7 and allocator.num_free == 16 - 5  # 17 positions
    processor.resolve(processor.advance(out, live), [40, 0, 0, 0, 0, 0, 0])
    scheduler.update_from_output([request])  # the step settles
    request.draft_token_ids = []
    out = scheduler.schedule()
    assert out.scheduled[0].start == 11  # 21 at position 10 was computed and kept
    assert len(scheduler.block_tables(request)[0]) == 3
    assert allocator.num_free == 16 - 3
    # Only the two full blocks of accepted tokens are in the prefix cache.
    assert allocator.num_cached == 2
    same = Request("b", request.token_ids[:8] + [1], SamplingParams(), 1)
    assert len(scheduler.kv.cached_prefix(same)) == 2


def test_proposals_stop_at_max_new_tokens():
    scheduler = Scheduler(BlockAllocator(16), 4, max_batch_tokens=64, max_num_seqs=4)
    processor = OutputProcessor(set(), 1 << 20)
    request = Request("a", [3, 4], SamplingParams(max_new_tokens=3), 0)
    scheduler.add(request)
    live = {"a": request}
    processor.resolve(processor.advance(scheduler.schedule(), live), [5])
    request.draft_token_ids = [6, 7, 8, 9]
    out = scheduler.schedule()
    assert out.scheduled[0].num_drafts == 1  # one output so far, two more at most
    outputs, done = processor.resolve(processor.advance(out, live), [6, 7])
    assert outputs[0].new_token_ids == [6, 7] and done and request.output_token_ids == [5, 6, 7]


def _run(model, prompts, max_new, config, propose):
    """Greedy outputs with ``propose(request, reference)`` writing drafts before each step."""
    references = {str(i): reference_greedy(model, p, max_new) for i, p in enumerate(prompts)}
    results = {}
    drafted = 0
    with EngineCore(model, config) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new), str(i))
        while engine.has_unfinished():
            for request in engine.scheduler.running:
                request.draft_token_ids = propose(request, references[request.request_id])
                drafted += len(request.draft_token_ids)
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
        assert engine.allocator.num_used == 0
        engine.allocator.check_invariants()
        # A request sharing the prompts' prefixes reads only accepted K/V from the cache.
        again = {}
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new), f"again{i}")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    again[out.request_id] = out.token_ids
    assert drafted > 0
    return [results[str(i)] for i in range(len(prompts))], references, again


def _right(request, reference):
    done = request.num_output_tokens
    return reference[done : done + 4]


def _wrong(request, reference):
    done = request.num_output_tokens
    return [(t + 1) % 200 + 3 for t in reference[done : done + 4]]


def _mixed(request, reference):
    rng = random.Random(request.num_tokens)
    right = _right(request, reference)
    keep = rng.randint(0, len(right))
    return right[:keep] + [(t + 7) % 200 + 3 for t in right[keep:]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("propose", [_right, _wrong, _mixed], ids=["right", "wrong", "mixed"])
def test_greedy_output_is_exact_whatever_is_proposed(arch, propose):
    model = make_tiny_model(arch)
    prompts = random_prompts(5, 3, 30, seed=31)
    # Small blocks and batches: chunked prefill, and preemption with the prefix cache.
    config = EngineConfig(block_size=4, num_blocks=40, max_batch_tokens=24, max_num_seqs=4)
    outputs, references, again = _run(model, prompts, 16, config, propose)
    expected = [references[str(i)] for i in range(len(prompts))]
    assert outputs == expected
    assert [again[f"again{i}"] for i in range(len(prompts))] == expected


def test_right_proposals_take_fewer_steps():
    model = make_tiny_model("llama")
    prompt = random_prompts(1, 8, 8, seed=5)[0]
    reference = reference_greedy(model, prompt, 24)
    steps = {}
    for name, propose in (("plain", lambda r, ref: []), ("right", _right)):
        with EngineCore(model, EngineConfig(block_size=4, num_blocks=64)) as engine:
            engine.add_request(prompt, SamplingParams(max_new_tokens=24), "0")
            count, tokens = 0, []
            while engine.has_unfinished():
                for request in engine.scheduler.running:
                    request.draft_token_ids = propose(request, reference)
                for out in engine.step():
                    tokens = out.token_ids
                count += 1
        assert tokens == reference
        steps[name] = count
    # 1 prefill step, then 23 tokens: one a step plain, five a step (four drafts + one).
    assert steps == {"plain": 24, "right": 1 + 5}
