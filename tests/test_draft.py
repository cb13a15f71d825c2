"""Draft-model proposers (``cbgen.spec.draft``): a second model, or the target's first layers,
guesses tokens the target verifies. Output is exact whatever the draft says; the draft's
own cache gives back every block.

Drafts here: a copy of the target (every guess right), another random model (every
guess wrong) and the target's first layer (some right).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ARCHITECTURES,
    SPECULATION_MIXES,
    echo_prompts,
    make_tiny_model,
    random_prompts,
    reference_greedy,
    run_until_done,
)

from cbgen import EngineConfig, EngineCore, SamplingParams, SpeculativeConfig
from cbgen.spec.draft import DraftModelProposer, decoder_layers, layer_skip_model

MAX_NEW = 24
# k always 4, whatever the batch: the most guesses to verify and to reject.
FIXED = dict(adaptive=False, disable_batch_size=None)
CONFIG_ASYNC = dict(block_size=4, num_blocks=128, max_batch_tokens=64, async_scheduling=True)


def _drafts(model, arch: str) -> dict[str, SpeculativeConfig]:
    return {
        "layer_skip": _layer_skip(),
        "same": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model), **FIXED),
        "other": SpeculativeConfig(
            method="draft", draft_model=make_tiny_model(arch, seed=3), **FIXED
        ),
    }


def _layer_skip() -> SpeculativeConfig:
    """Guesses from the target's first layer, k always 4: many guesses, most wrong."""
    return SpeculativeConfig(method="layer_skip", num_layers=1, **FIXED)


def _run(model, prompts, spec, params=None, **overrides):
    """Outputs and stats of one engine run; checks both caches gave every block back."""
    base = dict(block_size=4, num_blocks=128, max_batch_tokens=64)
    base.update(overrides)
    params = params or SamplingParams(max_new_tokens=MAX_NEW)
    with EngineCore(model, EngineConfig(speculative=spec, **base)) as engine:
        assert isinstance(engine.proposer, DraftModelProposer)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, str(i))
        results = run_until_done(engine)
        for allocator in (engine.allocator, engine.proposer.allocator):
            assert allocator.num_free == allocator.num_blocks
            allocator.check_invariants()
        stats = dict(engine.stats)
    return [results[str(i)] for i in range(len(prompts))], stats


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_skip_output_matches_generate(arch):
    model = make_tiny_model(arch)
    prompts = echo_prompts(model, 3, seed=7)
    spec = _layer_skip()
    outputs, stats = _run(model, prompts, spec)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"], stats


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "mistral-sliding"])
@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_output_matches_generate(arch, draft):
    model = make_tiny_model(arch)
    prompts = echo_prompts(model, 3, seed=7)
    outputs, stats = _run(model, prompts, _drafts(model, arch)[draft])
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)
    if draft == "same":  # the target's own guesses: all kept
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0, stats
        assert stats["spec_mean_accepted_length"] > 4
    else:
        assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats


@pytest.mark.parametrize("overrides", SPECULATION_MIXES)  # the draft catches up in parts too
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_exact_under_chunking_preemption_caching_and_async(arch, overrides):
    model = make_tiny_model(arch)
    prompts = echo_prompts(model, 5, seed=11)
    spec = _layer_skip()
    outputs, stats = _run(model, prompts, spec, **overrides)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)
    assert stats["spec_proposed_tokens"] > 0
    if "num_blocks" in overrides:
        assert stats["preemptions"] > 0, "the cache was meant to be too small"


def test_async_steps_as_the_batch_crosses_the_limit_settle_guesses_in_flight():
    """Six requests, proposals only below four running: a step launched with guesses is
    settled before the next is planned even when that next step proposes nothing."""
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 6, seed=12)
    spec = SpeculativeConfig(
        method="layer_skip", num_layers=1, adaptive=False, disable_batch_size=4
    )
    params = [SamplingParams(max_new_tokens=8 + 6 * i) for i in range(6)]  # ends staggered
    with EngineCore(model, EngineConfig(**CONFIG_ASYNC, speculative=spec)) as engine:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(prompt, p, str(i))
        results = run_until_done(engine)
        assert engine.stats["spec_proposed_tokens"] > 0
        assert engine.allocator.num_free == engine.allocator.num_blocks
    for i, prompt in enumerate(prompts):
        assert results[str(i)].token_ids == reference_greedy(model, prompt, 8 + 6 * i)


def test_a_second_request_on_the_same_prefix_gets_the_same_output():
    """Rejected guesses leave nothing in the prefix cache: the same prompts again (now
    cached) give the same tokens, and every block of both caches comes back."""
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 4, seed=13)
    spec = _drafts(model, "llama")["other"]
    with EngineCore(model, EngineConfig(block_size=4, num_blocks=64, speculative=spec)) as engine:
        runs = []
        for round_ in range(2):
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW), f"{round_}-{i}")
            runs.append(run_until_done(engine))
        assert engine.allocator.num_free == 64
        assert engine.proposer.allocator.num_free == engine.proposer.allocator.num_blocks
        rejected = engine.stats["spec_proposed_tokens"] - engine.stats["spec_accepted_tokens"]
        assert rejected > 0
    for i, prompt in enumerate(prompts):
        first, second = runs[0][f"0-{i}"], runs[1][f"1-{i}"]
        assert second.num_cached_tokens > 0
        assert first.token_ids == second.token_ids == reference_greedy(model, prompt, MAX_NEW)


def test_aborted_and_finished_requests_give_back_draft_blocks():
    model = make_tiny_model("llama")
    spec = _layer_skip()
    with EngineCore(model, EngineConfig(block_size=4, num_blocks=64, speculative=spec)) as engine:
        proposer = engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        for i, prompt in enumerate(random_prompts(3, 6, 12, seed=2)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=40), str(i))
        for _ in range(4):
            engine.step()
        assert proposer.allocator.num_free < proposer.allocator.num_blocks
        engine.abort("0")
        held = proposer.allocator.num_blocks - proposer.allocator.num_free
        run_until_done(engine)
        assert held > 0 and proposer.allocator.num_free == proposer.allocator.num_blocks


def test_a_draft_with_a_larger_vocabulary_never_proposes_past_the_targets():
    model = make_tiny_model("llama")
    # Embeddings padded past the target's 256 ids, its head biased to the padding.
    draft = make_tiny_model("llama", seed=4, vocab_size=300)
    with torch.no_grad():
        draft.lm_head.weight[256:] *= 50
    prompts = echo_prompts(model, 3, seed=5)
    spec = SpeculativeConfig(method="draft", draft_model=draft, **FIXED)
    outputs, stats = _run(model, prompts, spec)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)


def test_layer_skip_model_shares_weights_and_leaves_the_target_whole():
    model = make_tiny_model("gemma3")
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    draft = layer_skip_model(model, 2)
    assert len(decoder_layers(model)[2]) == 4 and model.config.num_hidden_layers == 4
    assert len(decoder_layers(draft)[2]) == 2 and draft.config.num_hidden_layers == 2
    assert draft.config.layer_types == model.config.layer_types[:2]
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    shared = {p.data_ptr() for p in draft.parameters()}
    assert shared <= set(before.values())
    assert draft.model.layers[0] is not model.model.layers[0]
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        assert draft(ids).logits.shape == model(ids).logits.shape
    assert (
        layer_skip_model(make_tiny_model("llama", num_hidden_layers=8)).config.num_hidden_layers
        == 2
    )
    with pytest.raises(ValueError, match="num_layers < 4"):
        layer_skip_model(model, 4)


def test_a_draft_must_be_another_model_on_the_same_device():
    model = make_tiny_model("llama")
    spec = SpeculativeConfig(method="draft", draft_model=model)
    with pytest.raises(ValueError, match="the target itself"):
        EngineCore(model, EngineConfig(num_blocks=16, speculative=spec))
    # The failed engine gave the model its own attention back.
    assert model.config._attn_implementation != "cbgen_paged"


def test_adaptive_k_nearly_stops_guessing_with_a_draft_that_is_always_wrong():
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 2, seed=9)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    proposed = {}
    for adaptive in (False, True):
        draft = make_tiny_model("llama", seed=3)
        spec = SpeculativeConfig(method="draft", draft_model=draft, adaptive=adaptive)
        outputs, stats = _run(model, prompts, spec, params, max_batch_tokens=256)
        assert stats["spec_accepted_tokens"] <= 2  # guesses of other random weights
        proposed[adaptive] = stats["spec_proposed_tokens"]
        assert all(len(out.token_ids) == 64 for out in outputs)
    # Fixed k: 4 guesses a step. Adaptive: a few at first, then probes ever further apart.
    assert proposed[False] > 4 * 50
    assert 0 < proposed[True] < proposed[False] / 8


def test_a_request_the_draft_fell_far_behind_on_decodes_plainly():
    """Proposals off while four or more requests run; three short ones leave after 25
    tokens, and the three long ones, 25 tokens ahead of the draft by then, decode plainly
    to their end (no catch-up over their history), their draft blocks given back."""
    model = make_tiny_model("llama")
    prompts = random_prompts(6, 4, 8, seed=14)
    spec = SpeculativeConfig(
        method="layer_skip", num_layers=1, adaptive=False, disable_batch_size=4
    )
    lengths = [60, 60, 60, 25, 25, 25]
    with EngineCore(model, EngineConfig(**CONFIG_ASYNC, speculative=spec)) as engine:
        proposer = engine.proposer
        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), str(i))
        results = run_until_done(engine)
        assert engine.stats["spec_proposed_tokens"] == 0
        assert proposer.allocator.num_free == proposer.allocator.num_blocks
    assert [len(results[str(i)].token_ids) for i in range(6)] == lengths
