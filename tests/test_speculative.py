"""Speculative decoding with prompt lookup (``cbgen.spec.speculative``): exact whatever is
proposed, and rejections leave no trace in the cache.

Prompts repeat themselves (a text, the model's own continuation of it, the text again),
so the n-gram proposer finds matches: some of its guesses are the target's tokens, most
are not, which exercises acceptance and rollback both.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ARCHITECTURES,
    SPECULATION_MIXES,
    echo_prompts,
    make_tiny_model,
    reference_greedy,
    run_until_done,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen import EngineConfig, EngineCore, SamplingParams, SpeculativeConfig
from cbgen.bench.workloads import chat_token_ids
from cbgen.requests.acceptance import DraftAcceptance
from cbgen.requests.request import Request
from cbgen.spec.speculative import NgramProposer, guess_cost

MAX_NEW = 24


def _run(model, prompts, config, params=None, proposer=None):
    """Every request's final output, and the engine's stats; checks the allocator."""
    params = params or SamplingParams(max_new_tokens=MAX_NEW)
    with EngineCore(model, config) as engine:
        if proposer is not None:
            engine.proposer = proposer
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, str(i))
        results = run_until_done(engine)
        assert engine.allocator.num_free == engine.allocator.num_blocks
        engine.allocator.check_invariants()
        stats = dict(engine.stats)
    return [results[str(i)] for i in range(len(prompts))], stats


def _spec(**overrides) -> EngineConfig:
    base = dict(block_size=4, num_blocks=128, max_batch_tokens=64)
    base.update(overrides)
    spec = SpeculativeConfig(num_tokens=4, disable_batch_size=None, adaptive=False)
    return EngineConfig(speculative=spec, **base)


def _eager() -> NgramProposer:
    """Matches on a single token: many proposals, many of them wrong."""
    return NgramProposer(4, min_ngram=1, max_ngram=3, adaptive=False)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_matches_generate_with_ngram_speculation(arch):
    model = make_tiny_model(arch)
    prompts = echo_prompts(model, 3, seed=7)
    outputs, stats = _run(model, prompts, _spec(), proposer=_eager())
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)
    proposed, accepted = stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]
    assert proposed > accepted, stats  # rejections (acceptances: the tests below)
    assert stats["spec_mean_accepted_length"] == 1 + accepted / stats["spec_verifications"]


@pytest.mark.parametrize("overrides", SPECULATION_MIXES)
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_exact_under_chunking_preemption_and_caching(arch, overrides):
    model = make_tiny_model(arch)
    prompts = echo_prompts(model, 5, seed=11)
    outputs, stats = _run(model, prompts, _spec(**overrides), proposer=_eager())
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"]
    if arch == "llama":
        assert stats["spec_accepted_tokens"] > 0, stats
    if "num_blocks" in overrides:
        assert stats["preemptions"] > 0, "the cache was meant to be too small"


def test_rejected_tokens_never_reach_the_prefix_cache():
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 4, seed=13)
    config = _spec(num_blocks=64)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    with EngineCore(model, config) as engine:
        engine.proposer = _eager()
        params = SamplingParams(max_new_tokens=MAX_NEW)
        first = {}
        for i, p in enumerate(prompts):
            engine.add_request(p, params, str(i))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    first[out.request_id] = out.token_ids
        rejected = engine.stats["spec_proposed_tokens"] - engine.stats["spec_accepted_tokens"]
        assert rejected > 0
        assert engine.allocator.num_free == config.num_blocks
        # Every cached block holds accepted tokens: a request made of a whole finished
        # sequence finds each of its full blocks, and its output is still exact.
        again = {}
        for i, p in enumerate(prompts):
            sequence = p + first[str(i)]
            probe = Request("probe", sequence, params, 0)
            assert len(engine.scheduler.kv.cached_prefix(probe)) == (len(sequence) - 1) // 4
            engine.add_request(sequence, params, f"again{i}")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    again[out.request_id] = out
        assert engine.allocator.num_free == config.num_blocks
    for i, p in enumerate(prompts):
        assert first[str(i)] == expected[i]
        out = again[f"again{i}"]
        assert out.num_cached_tokens > 0
        assert out.token_ids == reference_greedy(model, p + expected[i], MAX_NEW)


def test_a_request_can_opt_out():
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 3, seed=7)
    params = SamplingParams(max_new_tokens=MAX_NEW, speculative=False)
    outputs, stats = _run(model, prompts, _spec(), params, proposer=_eager())
    assert stats["spec_proposed_tokens"] == 0 and stats["spec_verifications"] == 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, MAX_NEW)


def test_stop_strings_cut_the_same_text_with_speculation(smollm2):
    """Several tokens accepted in one step: the text still ends at the first stop string,
    with the same tokens as plain decoding (the bundled model quoting its prompt)."""
    model, tokenizer = smollm2
    message = "Repeat exactly: The quick brown fox jumps over the lazy dog. It was a sunny day."
    prompt = chat_token_ids(tokenizer, message)
    params = SamplingParams(max_new_tokens=40, stop=["lazy"], include_stop_str_in_output=True)
    outputs = []
    for speculative in (None, SpeculativeConfig(num_tokens=4)):
        config = EngineConfig(speculative=speculative)
        with EngineCore(model, config, tokenizer) as engine:
            engine.add_request(prompt, params, "a")
            outputs.append(run_until_done(engine)["a"])
            stats = dict(engine.stats)
    plain, spec = outputs
    assert stats["spec_accepted_tokens"] > 0, stats
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and spec.text.endswith("lazy")
    assert str(spec.finish_reason) == "stop"


def test_logprobs_are_the_same_with_speculation():
    model = make_tiny_model("qwen2")
    prompts = echo_prompts(model, 3, seed=7)
    params = SamplingParams(max_new_tokens=MAX_NEW, logprobs=2)
    plain, _ = _run(model, prompts, EngineConfig(block_size=4, num_blocks=128), params)
    spec, stats = _run(model, prompts, _spec(), params, proposer=_eager())
    assert stats["spec_accepted_tokens"] > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            for token in x:
                assert x[token] == pytest.approx(y[token], abs=1e-4)


DIST_VOCAB = 8
DIST_PROMPT = [3, 4, 5, 3, 4, 6, 3, 4]


def _distribution_model(seed=0):
    """A model of 8 tokens, where single-token lookup (or a draft model of other random
    weights) proposes often and is often wrong."""
    return make_tiny_model(
        "llama", seed=seed, vocab_size=DIST_VOCAB, pad_token_id=0, bos_token_id=1
    )


def _target_joint(model, prompt):
    """The target's exact probabilities of its first three sampled tokens at temperature 1,
    ``[t1, t2, t3]``: one forward over every two-token continuation of ``prompt``."""
    v = DIST_VOCAB
    seqs = torch.tensor([[*prompt, a, b] for a in range(v) for b in range(v)])
    with torch.inference_mode():
        p = torch.softmax(model(seqs).logits[:, -3:].double(), dim=-1)
    first, second, third = p[0, 0], p[::v, 1], p[:, 2].reshape(v, v, v)
    return first[:, None, None] * second[:, :, None] * third


def _fit_pvalue(counts, probs, min_expected=5.0):
    """Chi-square goodness of fit of ``counts`` to ``probs``; the cells expected fewer
    than ``min_expected`` times are pooled into one (the test's approximation needs it)."""
    chisquare = pytest.importorskip("scipy.stats").chisquare
    n = sum(counts)
    kept = [i for i, q in enumerate(probs) if q * n >= min_expected]
    pooled = [i for i in range(len(probs)) if i not in kept]
    observed = [counts[i] for i in kept] + ([sum(counts[i] for i in pooled)] if pooled else [])
    expected = [probs[i] * n for i in kept] + (
        [sum(probs[i] for i in pooled) * n] if pooled else []
    )
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_follow_the_target_distribution(proposer):
    """The fast form of the check below, in the default suite (about a second): 2,000
    seeded requests (fixed seeds: the same draws every run) with speculation only, their
    third token and their (second, third) pair against the target's exact distribution,
    chi-square goodness of fit at 0.01%. A biased acceptance fails it: keeping every
    draft, or just the first, whatever the target sampled (the third token's test, either
    proposer), or the rows of one request drawing one random number together (the
    pair's test, p < 1e-7)."""
    model = _distribution_model()
    joint = _target_joint(model, DIST_PROMPT)
    samples = 2000
    if proposer == "draft":
        spec = SpeculativeConfig(
            method="draft",
            num_tokens=2,
            draft_model=_distribution_model(seed=5),
            disable_batch_size=None,
            adaptive=False,
        )
    else:
        spec = SpeculativeConfig(num_tokens=2, disable_batch_size=None, adaptive=False)
    config = EngineConfig(block_size=4, num_blocks=1024, max_num_seqs=256, speculative=spec)
    third, pairs = [0] * DIST_VOCAB, [0] * DIST_VOCAB**2
    with EngineCore(model, config) as engine:
        if proposer == "ngram":
            engine.proposer = NgramProposer(2, min_ngram=1, max_ngram=2, adaptive=False)
        for seed in range(samples):
            params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
            engine.add_request(DIST_PROMPT, params, str(seed))
        for out in run_until_done(engine).values():
            _, t2, t3 = out.token_ids
            third[t3] += 1
            pairs[t2 * DIST_VOCAB + t3] += 1
        stats = dict(engine.stats)
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"] > 0, stats
    assert _fit_pvalue(third, joint.sum(dim=(0, 1)).tolist()) > 1e-4, third
    assert _fit_pvalue(pairs, joint.sum(dim=0).flatten().tolist()) > 1e-4, pairs


@pytest.mark.slow  # the thorough form: against plain decoding's own samples
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampling_keeps_the_target_distribution(proposer):
    """A proposal is kept only where it equals the token the target samples there, so the
    tokens a sampled request gets have plain decoding's distribution (not its exact draws:
    rejected rows use random numbers too). On a model of 8 tokens, where single-token
    lookup (or a draft model of other random weights) proposes often and is often wrong,
    the third output token's counts over many seeds with and without speculation pass a
    chi-square test of homogeneity at 0.1%."""
    chi2_contingency = pytest.importorskip("scipy.stats").chi2_contingency
    vocab = 8
    model = make_tiny_model("llama", vocab_size=vocab, pad_token_id=0, bos_token_id=1)
    prompt = [3, 4, 5, 3, 4, 6, 3, 4]
    samples = 400
    counts = []
    draft = make_tiny_model("llama", seed=5, vocab_size=vocab, pad_token_id=0, bos_token_id=1)
    spec = SpeculativeConfig(
        method="draft", num_tokens=2, draft_model=draft, disable_batch_size=None, adaptive=False
    )
    for speculate in (False, True):
        config = EngineConfig(block_size=4, num_blocks=1024, max_num_seqs=samples)
        if speculate and proposer == "draft":
            config = EngineConfig(
                block_size=4, num_blocks=1024, max_num_seqs=samples, speculative=spec
            )
        elif speculate:
            config = _spec(num_blocks=1024, max_num_seqs=samples)
        hist = [0] * vocab
        stats: dict[str, float] = {}
        params_list = [
            SamplingParams(max_new_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
            for s in range(samples)
        ]
        with EngineCore(model, config) as engine:
            if speculate and proposer == "ngram":
                engine.proposer = NgramProposer(2, min_ngram=1, max_ngram=2, adaptive=False)
            for seed, params in enumerate(params_list):
                engine.add_request(prompt, params, str(seed))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        hist[out.token_ids[2]] += 1
            stats = dict(engine.stats)
        if speculate:
            proposed, accepted = stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]
            assert proposed > accepted > 0, stats
        counts.append(hist)
    used = [t for t in range(vocab) if counts[0][t] + counts[1][t] > 0]
    table = [[row[t] for t in used] for row in counts]
    assert chi2_contingency(table).pvalue > 0.001, table


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(3, min_ngram=2, max_ngram=3)
    assert proposer.lookup([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # latest
    assert proposer.lookup([5, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]  # 2-gram "2 3"
    assert proposer.lookup([7, 1, 2, 3]) == []  # no earlier occurrence
    assert proposer.lookup([1, 2, 1, 2]) == [1, 2]  # overlapping, cut at the end
    assert NgramProposer(2, min_ngram=1, max_ngram=2).lookup([4, 6, 4]) == [6, 4]
    # The longest n wins over a more recent shorter match.
    assert proposer.lookup([1, 2, 3, 8, 0, 2, 3, 9, 1, 2, 3]) == [8, 0, 2]


def test_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model is for method='draft'"):
        SpeculativeConfig(method="ngram", draft_model=make_tiny_model("llama"))
    with pytest.raises(ValueError, match="num_layers must be"):
        SpeculativeConfig(method="layer_skip", num_layers=0)
    with pytest.raises(ValueError, match="num_layers is for"):
        SpeculativeConfig(method="ngram", num_layers=2)
    with pytest.raises(ValueError, match="disable_batch_size"):
        SpeculativeConfig(disable_batch_size=0)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative=1).validate()  # type: ignore[arg-type]


def test_draft_length_follows_the_kept_fraction():
    sure = DraftAcceptance()
    for _ in range(20):
        sure.record(4, 4)
    assert sure.rate > 0.95 and sure.draft_length(4, guess_cost(1)) == 4
    hopeless = DraftAcceptance()
    for _ in range(20):
        hopeless.record(4, 0)
    assert hopeless.rate < 0.05
    # Not worth a guess: none, but for probes ever further apart (8, then 16, ... chances).
    lengths = [hopeless.draft_length(4, 0.3) for _ in range(8 + 16 + 32)]
    probes = [i + 1 for i, k in enumerate(lengths) if k]
    assert probes == [8, 8 + 16, 8 + 16 + 32] and set(lengths) == {0, 1}
    # A draft model's guesses cost more than lookup's: fewer of them at the same rate.
    middling = DraftAcceptance(kept=3.0, rejected=1.0)  # rate 0.75
    assert middling.draft_length(8, 0.05) == 8 >= middling.draft_length(8, 0.3) == 4


@settings(deadline=None)  # a loaded machine is no failure
@given(
    verifications=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 6)).map(lambda t: (t[0], min(t[0], t[1]))),
        max_size=30,
    ),
    most=st.integers(1, 8),
    cost=st.floats(0.0, 1.5),
)
def test_draft_length_stays_in_range_and_falls_with_cost(verifications, most, cost):
    acceptance = DraftAcceptance()
    for verified, kept in verifications:
        acceptance.record(verified, kept)
    assert 0.0 < acceptance.rate <= 1.0
    length = acceptance.draft_length(most, cost)
    assert 0 <= length <= most
    # A cheaper guess is never made less often (a fresh copy: no probe counted yet).
    cheaper = DraftAcceptance(acceptance.kept, acceptance.rejected)
    dearer = DraftAcceptance(acceptance.kept, acceptance.rejected)
    assert cheaper.draft_length(most, cost / 2) >= dearer.draft_length(most, cost)


@pytest.mark.parametrize("limit", [4, None])
def test_no_proposals_while_the_batch_is_too_large(limit):
    """Six requests of equal length run together: with ``disable_batch_size=4`` none is
    ever proposed for (they finish together); without a limit they are."""
    model = make_tiny_model("llama")
    prompts = echo_prompts(model, 6, seed=3)
    config = EngineConfig(
        block_size=4,
        num_blocks=256,
        speculative=SpeculativeConfig(num_tokens=4, disable_batch_size=limit),
    )
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outputs, stats = _run(model, prompts, config, params, proposer=_eager())
    if limit is None:
        assert stats["spec_proposed_tokens"] > 0
    else:
        assert stats["spec_proposed_tokens"] == 0
    assert all(len(out.token_ids) == MAX_NEW for out in outputs)
