"""The batch processors equal a plain per-row, per-token reference on random batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.sampling.logits import LogitsRows, apply_processors, default_processors
from cbgen.sampling.params import SamplingParams

VOCAB = 12
EOS = 0
token = st.integers(0, VOCAB - 1)


@st.composite
def rows(draw):
    prompt = draw(st.lists(token, min_size=1, max_size=6))
    output = draw(st.lists(token, max_size=6))
    params = SamplingParams(
        repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
        presence_penalty=draw(st.sampled_from([0.0, 0.7, -0.4])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3, -1.0])),
        logit_bias=draw(st.dictionaries(token, st.floats(-5, 5), max_size=3)),
        bad_words=draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=3)),
        min_tokens=draw(st.integers(0, 4)),
        stop_token_ids=draw(st.lists(token, max_size=2)),
    )
    return params, prompt, output


def reference(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """One row, one token at a time, in the documented order."""
    out = logits.clone()
    for tid, value in (params.logit_bias or {}).items():
        out[tid] += value
    history = prompt + output
    for words in params.bad_words:
        prefix = list(words[:-1])
        if not prefix or history[len(history) - len(prefix) :] == prefix:
            out[words[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        for tid in {EOS, *params.stop_ids}:
            out[tid] = float("-inf")
    for tid in set(history):
        value = out[tid]
        out[tid] = (
            value * params.repetition_penalty if value < 0 else value / params.repetition_penalty
        )
    for tid in set(output):
        out[tid] -= params.presence_penalty + params.frequency_penalty * output.count(tid)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(rows(), min_size=1, max_size=5), st.integers(0, 2**31))
def test_processors_equal_the_per_row_reference(batch, seed):
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = torch.stack([reference(logits[i], *row) for i, row in enumerate(batch)])
    state = LogitsRows(
        [params for params, _, _ in batch],
        [len(prompt) for _, prompt, _ in batch],
        [len(output) for _, _, output in batch],
        [prompt + output for _, prompt, output in batch],
    )
    apply_processors(default_processors([EOS]), logits, state)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-5)
