"""The input processor: one set of rules and one n-sample fan-out for every front end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen import SamplingParams
from cbgen.core.input_processor import InputProcessor, fan_out

PROCESSOR = InputProcessor(vocab_size=100, max_model_len=10)


def test_valid_prompts_come_back_as_lists():
    assert PROCESSOR.validate("a", [1, 2, 99], SamplingParams()) == [1, 2, 99]
    assert PROCESSOR.validate("a", torch.tensor([[4, 5]]), SamplingParams()) == [4, 5]
    assert PROCESSOR.validate("a", (7,) * 9, SamplingParams(top_k=100)) == [7] * 9


def test_a_one_sample_front_end_names_where_n_samples_belong():
    with pytest.raises(ValueError, match=r"request 'a': n=3 samples belong elsewhere"):
        PROCESSOR.validate("a", [1, 2], SamplingParams(n=3), one_sample="belong elsewhere")
    # Without the rule (generate_batch fans out first), n is for the caller to split.
    assert PROCESSOR.validate("a", [1, 2], SamplingParams(n=3)) == [1, 2]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1, 100], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2.0], SamplingParams(), "must be ints"),
        ([1, True], SamplingParams(), "must be ints"),
        ([1] * 10, SamplingParams(), "context limit is 10"),
        ([1], SamplingParams(top_k=101), "vocabulary size 100"),
        ([1], SamplingParams(seed=2**64), "seed"),
        ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1], {"max_new_tokens": 3}, "must be SamplingParams"),
    ],
)
def test_bad_requests_are_named(prompt, params, message):
    with pytest.raises(ValueError, match=rf"request 'r7': .*{message}"):
        PROCESSOR.validate("r7", prompt, params)


def test_fan_out_gives_n_single_samples_with_consecutive_seeds():
    samples = fan_out("x", SamplingParams(n=3, temperature=0.7, seed=5, max_new_tokens=4))
    assert [s.n for s in samples] == [1, 1, 1]
    assert [s.seed for s in samples] == [5, 6, 7]
    assert {(s.temperature, s.max_new_tokens) for s in samples} == {(0.7, 4)}
    unseeded = fan_out("x", SamplingParams(n=2, temperature=1.0))
    assert [s.seed for s in unseeded] == [None, None]
    single = SamplingParams()
    assert fan_out("x", single) == [single]  # the same object: nothing to split
    with pytest.raises(ValueError, match="request 'x': top_p"):
        fan_out("x", SamplingParams(n=2, top_p=0.0))


@settings(deadline=None)
@given(seed=st.integers(0, 2**64 - 1), n=st.integers(1, 8))
def test_fanned_out_seeds_are_always_valid_and_distinct(seed, n):
    samples = fan_out("h", SamplingParams(n=n, temperature=1.0, seed=seed))
    seeds = [s.seed for s in samples]
    assert len(set(seeds)) == n and all(0 <= s < 2**64 for s in seeds)
    for s in samples:
        s.validate()
