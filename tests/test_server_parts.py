"""The server's parts alone, without an engine or a socket: translating an OpenAI body into
prompts and ``SamplingParams`` (and its 4xx answers), the response shapes of completions and
chat, and the intake checks (API key, body limits) on real Starlette requests."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from starlette.requests import Request  # noqa: E402

from cbgen.bench.workloads import load_tokenizer  # noqa: E402
from cbgen.core.input_processor import strip_request_prefix  # noqa: E402
from cbgen.frontends.online import OnlineRequestOutput  # noqa: E402
from cbgen.frontends.server import app as server_app  # noqa: E402
from cbgen.frontends.server.intake import check_api_key, read_json  # noqa: E402
from cbgen.frontends.server.protocol import APIError  # noqa: E402
from cbgen.frontends.server.responses import ResponseShape  # noqa: E402
from cbgen.frontends.server.translate import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    Translator,
    max_token_chars,
    prompt_list,
)
from cbgen.requests.request import FinishReason  # noqa: E402

MODEL = "m"
CONTEXT = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture
def translator(tokenizer):
    t = Translator(
        tokenizer, MODEL, CONTEXT, max_choices=8, max_tokens_limit=None, tokenizer_threads=1
    )
    yield t
    t.close()


def completion(translator, **body):
    return asyncio.run(translator.completion({"model": MODEL, **body}))


def chat(translator, **body):
    return asyncio.run(translator.chat({"model": MODEL, **body}))


def refusal(fn, *args, **body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **body)
    return info.value


# -- translation ---------------------------------------------------------------------------


def test_completion_with_token_ids_uses_openai_defaults(translator):
    work = completion(translator, prompt=[5, 6, 7])
    assert not work.chat and work.prompts == [[5, 6, 7]] and work.n == 1
    assert work.stop is None and not work.stream and not work.include_usage
    assert work.timeout is None
    (params,) = work.params
    assert params.max_new_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.seed is None and not params.ignore_eos and params.priority == 0


def test_completion_fields_reach_the_sampling_params(translator):
    work = completion(
        translator,
        prompt=[[1, 2], [3]],
        n=2,
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        seed=7,
        ignore_eos=True,
        priority=-3,
        stop="x",
        stream=True,
        stream_options={"include_usage": True},
        timeout=2.5,
    )
    assert work.prompts == [[1, 2], [3]] and work.n == 2 and work.stop == ["x"]
    assert work.stream and work.include_usage and work.timeout == 2.5
    assert len(work.params) == 2
    for params in work.params:
        assert params.max_new_tokens == 5 and params.temperature == 0.5
        assert params.top_p == 0.9 and params.top_k == 0 and params.seed == 7
        assert params.ignore_eos and params.priority == -3


def test_completion_tokenizes_text_prompts(translator, tokenizer):
    work = completion(translator, prompt=["Hello there", "Bye"], max_tokens=1)
    assert work.prompts == [tokenizer(p)["input_ids"] for p in ("Hello there", "Bye")]


def test_default_max_tokens_fits_the_context_and_the_server_cap(translator):
    assert completion(translator, prompt=[1] * 60).params[0].max_new_tokens == 4
    translator.max_tokens_limit = 3
    assert completion(translator, prompt=[1]).params[0].max_new_tokens == 3
    err = refusal(completion, translator, prompt=[1], max_tokens=4)
    assert (err.status, err.param) == (400, "max_tokens")
    assert "at most 3" in err.message


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "other"}, 404, "model", "model_not_found"),
        ({"n": 0}, 400, "n", None),
        ({"n": 9}, 400, "n", None),
        ({"prompt": [[1]] * 5, "n": 2}, 400, "n", None),
        ({"prompt": [[1]] * 9}, 400, "prompt", None),
        ({"prompt": []}, 400, "prompt", None),
        ({"prompt": ""}, 400, "prompt", None),
        ({"stop": ""}, 400, "stop", None),
        ({"stop": ["a"] * 17}, 400, "stop", None),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", None),
        ({"temperature": 2.5}, 400, "temperature", None),
        ({"top_p": 0}, 400, "top_p", None),
        ({"top_k": -2}, 400, "top_k", None),
        ({"priority": 2**31 + 1}, 400, "priority", None),
        ({"max_tokens": 0}, 400, "max_tokens", None),
        ({"max_tokens": 62}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": [1] * CONTEXT}, 400, "prompt", "context_length_exceeded"),
        ({"suffix": "x"}, 400, "suffix", "unsupported_parameter"),
        ({"logprobs": 21}, 400, "logprobs", None),
        ({"max_tokens": 0, "logprobs": 1}, 400, "max_tokens", None),
    ],
)
def test_completion_refusals(translator, body, status, param, code):
    body = {"prompt": [1, 2, 3], **body}
    err = refusal(completion, translator, **body)
    assert (err.status, err.param) == (status, param)
    if code is not None:
        assert err.code == code


def test_text_that_cannot_fit_is_refused_before_tokenizing(translator):
    chars = translator.max_prompt_chars + 1
    assert chars == CONTEXT * max_token_chars(translator.tokenizer) + 1
    err = refusal(completion, translator, prompt="a" * chars)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    err = refusal(chat, translator, messages=[{"role": "user", "content": "a" * chars}])
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")


def test_chat_applies_the_template(translator, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    work = chat(translator, messages=messages, n=3)
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert work.chat and work.prompts == [list(expected)] and work.n == 3
    # no default length for chat: the rest of the context
    assert work.params[0].max_new_tokens == CONTEXT - len(expected)


def test_chat_prefers_max_completion_tokens(translator):
    messages = [{"role": "user", "content": "Hi"}]
    work = chat(translator, messages=messages, max_tokens=2, max_completion_tokens=3)
    assert work.params[0].max_new_tokens == 3
    assert chat(translator, messages=messages, max_tokens=2).params[0].max_new_tokens == 2


def test_chat_refusals(translator):
    long = [{"role": "user", "content": "word " * 200}]
    err = refusal(chat, translator, messages=long)
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    err = refusal(chat, translator, messages=[{"role": "user", "content": "Hi"}], tools=[{}])
    assert (err.status, err.param) == (400, "tools")


def test_prompt_list_reads_every_prompt_form():
    assert prompt_list("a") == ["a"]
    assert prompt_list([1, 2]) == [[1, 2]]
    assert prompt_list(["a", "b"]) == ["a", "b"]
    assert prompt_list([[1], [2]]) == [[1], [2]]
    assert prompt_list([]) == []


def test_app_keeps_its_old_names():
    assert server_app.max_token_chars is max_token_chars
    assert server_app.DEFAULT_COMPLETION_MAX_TOKENS == DEFAULT_COMPLETION_MAX_TOKENS
    assert server_app.DEFAULT_MAX_BODY_BYTES == 1 << 20


def test_strip_request_prefix():
    assert strip_request_prefix("request 'abc-0': too long") == "too long"
    assert strip_request_prefix("plain message") == "plain message"


# -- response shapes -----------------------------------------------------------------------


def final(text: str, reason: FinishReason) -> OnlineRequestOutput:
    return OnlineRequestOutput("r", [1], [2, 3], True, reason, text=text)


def test_new_shapes_name_their_call():
    chat_shape, text_shape = ResponseShape.new(True, MODEL), ResponseShape.new(False, MODEL)
    assert chat_shape.call_id.startswith("chatcmpl-") and text_shape.call_id.startswith("cmpl-")
    assert ResponseShape.new(True, MODEL).call_id != chat_shape.call_id
    assert isinstance(chat_shape.created, int) and chat_shape.model == MODEL


def test_completion_response():
    shape = ResponseShape(False, "cmpl-1", 10, MODEL)
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    body = shape.response([final("ab", FinishReason.EOS), final("c", FinishReason.LENGTH)], usage)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 10,
        "model": MODEL,
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"},
            {"index": 1, "text": "c", "logprobs": None, "finish_reason": "length"},
        ],
        "usage": usage,
    }


def test_chat_response():
    shape = ResponseShape(True, "chatcmpl-1", 10, MODEL)
    body = shape.response([final("hi", FinishReason.ABORTED)], {})
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "abort",
        }
    ]


def test_stream_chunks_of_both_shapes():
    text_shape = ResponseShape(False, "cmpl-1", 10, MODEL)
    chat_shape = ResponseShape(True, "chatcmpl-1", 10, MODEL)
    assert text_shape.chunk_head() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 10,
        "model": MODEL,
    }
    assert chat_shape.chunk_head() == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 10,
        "model": MODEL,
        "system_fingerprint": None,
    }
    assert text_shape.chunk_choice(1, "x", None) == {
        "index": 1,
        "text": "x",
        "logprobs": None,
        "finish_reason": None,
    }
    assert chat_shape.chunk_choice(1, "x", None)["delta"] == {"content": "x"}
    assert chat_shape.chunk_choice(0, "", "stop")["delta"] == {}
    assert text_shape.opening_choices(2) == []
    openings = chat_shape.opening_choices(2)
    assert [o["index"] for o in openings] == [0, 1]
    assert all(o["delta"] == {"role": "assistant", "content": ""} for o in openings)


# -- intake --------------------------------------------------------------------------------


def http_request(headers: dict[str, str], chunks: list[bytes] | None = None) -> Request:
    """A Starlette request whose body arrives in ``chunks`` (never, when ``None``)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    pending = list(chunks or [])

    async def receive():
        if chunks is None:
            await asyncio.Event().wait()  # the body never comes
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    return Request(scope, receive)


def test_api_key():
    check_api_key(http_request({}), None)
    check_api_key(http_request({"Authorization": "Bearer k"}), "k")
    check_api_key(http_request({"Authorization": "bearer  k "}), "k")
    for headers, message in [
        ({}, "Missing API key"),
        ({"Authorization": "Bearer x"}, "Incorrect API key"),
        ({"Authorization": "Basic k"}, "Incorrect API key"),
    ]:
        err = refusal(check_api_key, http_request(headers), "k")
        assert err.status == 401 and err.code == "invalid_api_key"
        assert message in err.message and err.headers == {"WWW-Authenticate": "Bearer"}


def read(request: Request, limit: int = 100, timeout: float = 30.0):
    return asyncio.run(read_json(request, limit, timeout))


def test_read_json_joins_the_chunks():
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    assert read(http_request({}, [body[:5], body[5:]])) == {"model": MODEL, "prompt": "x"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b"\xff", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
def test_read_json_refuses_what_is_not_an_object(body, message):
    err = refusal(read, http_request({}, [body]), limit=1 << 20)
    assert err.status == 400 and message in err.message


def test_read_json_refuses_large_bodies():
    declared = http_request({"Content-Length": "101"}, [b"{}"])
    assert refusal(read, declared).status == 413
    streamed = http_request({}, [b"{" + b" " * 60, b" " * 60 + b"}"])
    err = refusal(read, streamed)
    assert (err.status, err.code) == (413, "request_too_large")


def test_read_json_gives_up_on_a_body_that_never_comes():
    err = refusal(read, http_request({}, None), timeout=0.05)
    assert (err.status, err.code) == (408, "request_timeout")
    assert err.headers == {"Connection": "close"}


def test_extension_fields_become_sampling_params(translator):
    work = completion(
        translator,
        prompt=[1, 2, 3],
        max_tokens=4,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        min_p=0.1,
        min_tokens=2,
        stop_token_ids=[7, 8],
        logit_bias={"5": 250, "6": -1e9, " 9": 3},
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=2,
        echo=True,
    )
    params = work.params[0]
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.2,
        -0.5,
        0.5,
    )
    assert (params.min_p, params.min_tokens, tuple(params.stop_token_ids)) == (0.1, 2, (7, 8))
    assert params.logit_bias == {5: 100.0, 6: -100.0, 9: 3.0}
    assert params.include_stop_str_in_output and params.logprobs == 2
    assert params.prompt_logprobs == 2  # echo with logprobs scores the prompt
    assert work.text_options == {
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    assert work.report.echo and work.report.echo_texts == [translator.tokenizer.decode([1, 2, 3])]


def test_max_tokens_zero_with_echo_runs_one_token(translator):
    work = completion(translator, prompt="Hi", max_tokens=0, echo=True, logprobs=0)
    assert work.params[0].max_new_tokens == 1 and work.report.drop_generated
    assert work.report.echo_texts == ["Hi"] and work.params[0].prompt_logprobs == 0


def test_chat_logprobs_fields(translator):
    messages = [{"role": "user", "content": "Hi"}]
    assert chat(translator, messages=messages).params[0].logprobs is None
    assert chat(translator, messages=messages, logprobs=True).params[0].logprobs == 0
    work = chat(translator, messages=messages, logprobs=True, top_logprobs=5, prompt_logprobs=1)
    assert (work.params[0].logprobs, work.params[0].prompt_logprobs) == (5, 1)
    for body, param in (
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"echo": True}, "echo"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ):
        err = refusal(chat, translator, messages=messages, **body)
        assert (err.status, err.param) == (400, param), body
