"""A batch job's row as a request: prompt or messages, per-row sampling fields, bad rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.bench.workloads import chat_token_ids, load_tokenizer
from cbgen.frontends.jobs.rows import error_fields, plain, row_request, sampling_defaults
from cbgen.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


DEFAULTS = SamplingParams(max_new_tokens=16, temperature=0.0)


def test_prompt_is_raw_text_and_messages_go_through_the_chat_template(tokenizer):
    text = row_request({"prompt": "Hello there"}, DEFAULTS, tokenizer)
    assert text.prompt_token_ids == tokenizer("Hello there")["input_ids"]
    chat = row_request({"messages": [{"role": "user", "content": "Hi"}]}, DEFAULTS, tokenizer)
    assert chat.prompt_token_ids == chat_token_ids(tokenizer, "Hi")
    assert text.params == chat.params == DEFAULTS


def test_row_fields_override_the_defaults_and_missing_values_do_not(tokenizer):
    row = {
        "prompt": "x",
        "max_new_tokens": 3.0,  # a pandas int column with a gap
        "temperature": np.float64(0.5),
        "top_k": None,
        "top_p": float("nan"),
        "stop": "END",
        "stop_token_ids": np.array([7, 9]),
        "ignore_eos": np.bool_(True),
    }
    params = row_request(row, DEFAULTS, tokenizer).params
    assert params.max_new_tokens == 3 and isinstance(params.max_new_tokens, int)
    assert params.temperature == 0.5 and type(params.temperature) is float
    assert params.top_k == DEFAULTS.top_k and params.top_p == DEFAULTS.top_p
    assert list(params.stop) == ["END"] and list(params.stop_token_ids) == [7, 9]
    assert params.ignore_eos is True


def test_messages_arrive_as_numpy_arrays_from_ray_data(tokenizer):
    turns = np.array([{"role": "user", "content": "Hi"}], dtype=object)
    assert row_request({"messages": turns, "prompt": None}, DEFAULTS, tokenizer).prompt_token_ids


@pytest.mark.parametrize(
    "row, message",
    [
        ({}, "needs `prompt`"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
        ({"prompt": 5}, "`prompt` must be text"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "role and content"),
        ({"prompt": "a", "n": 2}, "one sample per row"),
        ({"prompt": "a", "stop_token_ids": 5}, "stop_token_ids must be a list"),
    ],
)
def test_bad_rows_name_what_is_wrong(tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        row_request(row, DEFAULTS, tokenizer)


def test_defaults_are_checked_up_front():
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults({"temperature": -1.0})
    with pytest.raises(ValueError, match="unknown sampling fields"):
        sampling_defaults({"logits_processors": []})
    assert sampling_defaults({"max_new_tokens": 5}).max_new_tokens == 5


def test_error_fields_have_every_output_column():
    assert error_fields("bad") == {
        "text": None,
        "token_ids": [],
        "finish_reason": "error",
        "error": "bad",
    }


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text()
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(deadline=None)
@given(values)
def test_plain_leaves_python_values_as_they_are(value):
    assert plain(value) == value


@settings(deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=6))
def test_plain_turns_numpy_into_python(ints):
    assert plain(np.array(ints, dtype=np.int64)) == ints
    assert all(type(v) is int for v in plain(np.array(ints, dtype=np.int64)))
    assert plain(np.float64("nan")) is None
    assert plain([1.0, math.nan]) == [1.0, None]


def test_a_rows_constraint_becomes_its_structured_output(tokenizer):
    from cbgen.sampling.structured import StructuredOutput

    schema = {"type": "object"}
    request = row_request({"prompt": "x", "json_schema": schema}, DEFAULTS, tokenizer)
    assert request.params.structured_output == StructuredOutput(json_schema=schema)
    plain_row = row_request(
        {"prompt": "x", "json_object": False, "regex": None}, DEFAULTS, tokenizer
    )
    assert plain_row.params.structured_output is None
