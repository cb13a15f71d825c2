"""Logprobs, echo and vLLM's sampling extensions over HTTP, with the official ``openai``
client, on the tiny random Llama with SmolLM2's tokenizer of ``test_server``: every value
the server writes is compared with what the online engine itself returns for the same
prompt and ``SamplingParams``."""

from __future__ import annotations

import json

import pytest
from test_server import MODEL, assert_error, wait_idle
from test_server import server as server  # noqa: F401 - the module's server fixture

import cbgen

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox"


def engine_result(server, prompt_ids, **params):
    """The online engine's own final output for ``prompt_ids`` (greedy unless told)."""
    engine = server.engine
    params.setdefault("temperature", 0.0)
    rid = engine.add_request(list(prompt_ids), cbgen.SamplingParams(**params))
    return engine.get_result(rid, timeout=60)


def text_of(server, token_id):
    return server.tokenizer.decode([token_id], skip_special_tokens=False)


def test_completion_logprobs_match_the_engine(server):
    ids = server.tokenizer(PROMPT)["input_ids"]
    r = server.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    ref = engine_result(server, ids, max_new_tokens=6, logprobs=3, ignore_eos=True)
    lp = choice.logprobs
    assert lp.tokens == [text_of(server, t) for t in ref.token_ids]
    assert "".join(lp.tokens) == choice.text == ref.text
    assert lp.token_logprobs == [
        entry[t] for t, entry in zip(ref.token_ids, ref.logprobs, strict=False)
    ]
    for tops, token, entry in zip(lp.top_logprobs, ref.token_ids, ref.logprobs, strict=False):
        want = {text_of(server, t): v for t, v in list(entry.items())[:3]}
        want[text_of(server, token)] = entry[token]
        assert tops == want and len(tops) in (3, 4)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # logprobs=0: only the sampled token's
    r0 = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, logprobs=0)
    assert all(len(t) == 1 for t in r0.choices[0].logprobs.top_logprobs)
    wait_idle(server.engine)


def test_echo_gives_the_prompt_and_its_logprobs(server):
    """What lm-eval's loglikelihood reads: echo, logprobs=1, max_tokens 1 (or 0)."""
    ids = server.tokenizer("Paris is the capital of France")["input_ids"]
    ref = engine_result(server, ids, max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    r = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp.tokens == [text_of(server, t) for t in ids + ref.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t] for t, e in zip(ids[1:], ref.prompt_logprobs[1:], strict=False)] + [
        ref.logprobs[0][ref.token_ids[0]]
    ]
    assert lp.token_logprobs[1:] == want
    assert choice.text == server.tokenizer.decode(ids) + ref.text
    assert r.usage.completion_tokens == 1
    # max_tokens 0: the prompt alone, nothing generated shown or counted
    r = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    choice = r.choices[0]
    assert choice.text == server.tokenizer.decode(ids)
    assert choice.logprobs.token_logprobs == [None] + want[:-1]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    # a text prompt is echoed as given; several prompts keep their order
    r = server.client.completions.create(
        model=MODEL, prompt=["One", "Two two"], max_tokens=2, temperature=0, echo=True
    )
    assert [c.text[: len(p)] for c, p in zip(r.choices, ["One", "Two two"], strict=False)] == [
        "One",
        "Two two",
    ]
    wait_idle(server.engine)


def test_streamed_completion_logprobs_join_to_the_whole(server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=2, echo=True)
    whole = server.client.completions.create(**kw).choices[0]
    tokens, logprobs, offsets, text = [], [], [], ""
    for chunk in server.client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert logprobs == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset
    wait_idle(server.engine)


def test_chat_logprobs_match_the_engine(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    r = server.client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    prompt = server.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ref = engine_result(server, prompt, max_new_tokens=6, logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [text_of(server, t) for t in ref.token_ids]
    assert [c.logprob for c in content] == [
        e[t] for t, e in zip(ref.token_ids, ref.logprobs, strict=False)
    ]
    for item, entry in zip(content, ref.logprobs, strict=False):
        assert [(t.token, t.logprob) for t in item.top_logprobs] == [
            (text_of(server, t), v) for t, v in list(entry.items())[:2]
        ]
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == "".join(c.token for c in content)
    # streamed: the chunks' logprobs join to the same list
    streamed = []
    for chunk in server.client.chat.completions.create(
        **kw, logprobs=True, top_logprobs=2, stream=True
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content or []
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    # logprobs without top_logprobs: the tokens' own, no alternatives
    r = server.client.chat.completions.create(**kw, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    assert server.client.chat.completions.create(**kw).choices[0].logprobs is None
    wait_idle(server.engine)


def test_prompt_logprobs_extension(server):
    ids = server.tokenizer(PROMPT)["input_ids"]
    ref = engine_result(server, ids, max_new_tokens=1, prompt_logprobs=2)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    resp = server.http.post("/v1/completions", json=body, headers=server.auth).json()
    got = resp["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for token, entry, want in zip(ids[1:], got[1:], ref.prompt_logprobs[1:], strict=False):
        assert entry[str(token)]["logprob"] == want[token]
        ranks = [v["rank"] for k, v in entry.items() if int(k) in list(want)[:2]]
        assert sorted(ranks) == [1, 2]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
    }
    resp = server.http.post("/v1/chat/completions", json=chat, headers=server.auth).json()
    assert resp["prompt_logprobs"][0] is None and len(resp["prompt_logprobs"]) > 1
    wait_idle(server.engine)


def test_vllm_sampling_extensions_match_the_engine(server):
    ids = server.tokenizer(PROMPT)["input_ids"]
    fields = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "min_p": 0.05,
        "top_k": 20,
        "min_tokens": 4,
        "seed": 3,
    }
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0.8, **fields}
    resp = server.http.post("/v1/completions", json=body, headers=server.auth).json()
    ref = engine_result(server, ids, max_new_tokens=8, temperature=0.8, **fields)
    assert resp["choices"][0]["text"] == ref.text
    # logit_bias: string ids, values clamped to [-100, 100]
    token = ids[1]
    r = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, logit_bias={str(token): 1000}
    )
    ref = engine_result(server, ids, max_new_tokens=3, logit_bias={token: 100.0})
    assert r.choices[0].text == ref.text == server.tokenizer.decode([token] * 3)
    wait_idle(server.engine)


def test_stop_and_special_token_extensions(server):
    tok = server.tokenizer
    eos = tok.eos_token_id
    ids = tok(PROMPT)["input_ids"]
    # the end-of-text token forced, ignore_eos: skip_special_tokens decides whether it shows
    base = dict(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    hidden = server.client.completions.create(**base, extra_body={"ignore_eos": True})
    shown = server.client.completions.create(
        **base, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert hidden.choices[0].text == "" and shown.choices[0].text == tok.eos_token * 3
    r = server.client.completions.create(
        **base, extra_body={"ignore_eos": True, "spaces_between_special_tokens": False}
    )
    assert r.choices[0].text == ""
    # stop_token_ids end the request on that token ("stop")
    free = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    second = tok(free.choices[0].text)["input_ids"]
    ref = engine_result(server, ids, max_new_tokens=6)
    r = server.client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [ref.token_ids[1]]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2
    assert second  # the free text has tokens
    # include_stop_str_in_output keeps the stop string
    text = free.choices[0].text
    stop = text[2:5]
    cut = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, stop=stop
    )
    kept = server.client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert kept.choices[0].text == text[: text.index(stop)] + stop
    wait_idle(server.engine)


def test_extension_refusals(server):
    client = server.client
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21)
    assert_error(e, 400, "logprobs", "20")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, top_logprobs=2)
    assert_error(e, 400, "top_logprobs", "logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert_error(e, 400, "max_tokens", "echo")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert_error(e, 400, "prompt_logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, logit_bias={"abc": 1})
    assert_error(e, 400, "logit_bias")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, logit_bias={str(10**9): 1})
    assert_error(e, 400, "logit_bias")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, presence_penalty=3)
    assert_error(e, 400, "presence_penalty")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, extra_body={"repetition_penalty": 0})
    assert_error(e, 400, "repetition_penalty")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, extra_body={"min_tokens": 5})
    assert_error(e, 400, "min_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y")
    assert_error(e, 400, "suffix")
    wait_idle(server.engine)


@pytest.mark.parametrize(
    "field",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        {"structured_outputs": {"regex": "[ab]{3}"}},
        {"guided_regex": "[ab]{3}"},
        {"guided_json": {"type": "object"}},
    ],
)
def test_structured_output_fields(server, field):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    resp = server.http.post("/v1/chat/completions", json={**chat, **field}, headers=server.auth)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    if "regex" in json.dumps(field):
        assert len(text) == 3 and set(text) <= {"a", "b"}
    else:  # a JSON object, or cut short by max_tokens
        choice = resp.json()["choices"][0]
        assert text.lstrip().startswith("{") and (
            choice["finish_reason"] == "length" or isinstance(json.loads(text), dict)
        )
    wait_idle(server.engine)


def test_structured_output_refusals(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field in (
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"guided_regex": "a", "guided_json": {"type": "object"}},
    ):
        resp = server.http.post("/v1/chat/completions", json={**chat, **field}, headers=server.auth)
        assert resp.status_code == 400, (field, resp.text)
    resp = server.http.post(
        "/v1/chat/completions",
        json={**chat, "response_format": {"type": "text"}},
        headers=server.auth,
    )
    assert resp.status_code == 200
