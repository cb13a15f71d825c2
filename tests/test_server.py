"""The OpenAI-compatible server, driven over loopback with the official ``openai`` client.

One real uvicorn server (in a thread, on a free port) serves a tiny random Llama with
SmolLM2's tokenizer and full vocabulary, so text, chat templates and stop strings are
real while every step stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import hold_engine

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import cbgen  # noqa: E402
from cbgen.frontends.online import Engine  # noqa: E402
from cbgen.frontends.server import create_app  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny-smollm2"
NUM_BLOCKS = 64
BLOCK_SIZE = 16
CONTEXT = 512


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    folder = cbgen.models.loader.cache_dir() / "smollm2"
    if not (folder / "tokenizer.json").exists():
        try:
            cbgen.load_model("smollm2")  # converts the bundled model once
        except FileNotFoundError as exc:
            pytest.skip(f"the bundled smollm2 model is not installed: {exc}")
    return AutoTokenizer.from_pretrained(folder)


def tiny_model(tokenizer):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server():
    tokenizer = smollm2_tokenizer()
    engine = Engine(
        tiny_model(tokenizer),
        tokenizer,
        cbgen.EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
    )
    app = create_app(engine, tokenizer, MODEL, api_key=API_KEY)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    try:
        with uvicorn_in_thread(uv) as base:
            yield SimpleNamespace(
                base=base,
                engine=engine,
                tokenizer=tokenizer,
                client=openai.OpenAI(
                    base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60
                ),
                http=httpx.Client(base_url=base, timeout=60),
                app_server=app.state.cbgen,
                auth={"Authorization": f"Bearer {API_KEY}"},
            )
    finally:
        engine.close()


@contextlib.contextmanager
def uvicorn_in_thread(uv):
    """Run a ``uvicorn.Server`` in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()


def wait_idle(engine, timeout=15.0):
    """Until nothing runs or waits and every block is free (evictable cached ones count)."""
    core = engine.core
    deadline = time.monotonic() + timeout
    while True:
        idle = (
            not core.scheduler.running
            and not core.scheduler.waiting
            and core.allocator.num_free == core.allocator.num_blocks
        )
        if idle:
            return
        assert time.monotonic() < deadline, (
            f"not idle: {len(core.scheduler.running)} running, {len(core.scheduler.waiting)} "
            f"waiting, {core.allocator.num_free}/{core.allocator.num_blocks} blocks free"
        )
        time.sleep(0.02)


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# -- completions ----------------------------------------------------------------------------


def test_completion(server):
    r = server.client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(server.tokenizer("The quick brown fox")["input_ids"])
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    # greedy is reproducible, and a prompt of token ids is the same prompt
    ids = server.tokenizer("The quick brown fox")["input_ids"]
    again = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text
    # a batch of prompts: one choice each, in order
    batch = server.client.completions.create(
        model=MODEL, prompt=["The quick brown fox", "Hello"], max_tokens=8, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == choice.text
    wait_idle(server.engine)


def test_chat_completion(server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    r = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 6
    expected = server.tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": "Name a color."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert r.usage.prompt_tokens == len(expected)
    wait_idle(server.engine)


def test_streaming_completion_matches(server):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = server.client.completions.create(**kw).choices[0].text
    chunks = list(
        server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream is server-sent events ending with [DONE]
    with server.http.stream(
        "POST", "/v1/completions", json={**kw, "stream": True}, headers=server.auth
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == full
    wait_idle(server.engine)


def test_streaming_chat_matches(server):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=10,
        temperature=0,
    )
    full = server.client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(server.client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_idle(server.engine)


def test_n_samples_and_seed(server):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=3,
    )
    first = server.client.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # seeds 7, 8, 9
    assert first.usage.completion_tokens == 24
    again = server.client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == texts
    # streamed: every choice arrives, tagged with its index, and adds up to the same texts
    streamed = ["", "", ""]
    finished = set()
    for chunk in server.client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == texts and finished == {0, 1, 2}
    wait_idle(server.engine)


def test_stop_strings(server):
    kw = dict(model=MODEL, prompt="In the beginning", max_tokens=16, temperature=0)
    full = server.client.completions.create(**kw).choices[0].text
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    assert len(stop) == 3
    expected = full[: full.find(stop)]
    r = server.client.completions.create(**kw, stop=[stop, "never-appears"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(server.client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_idle(server.engine)


def test_models_health_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = server.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    server.client.completions.create(model=MODEL, prompt="Metrics", max_tokens=4, temperature=0)
    wait_idle(server.engine)
    resp = server.http.get("/metrics")  # open without the key, like /health
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert metric(text, "cbgen_requests_running") == 0
    assert metric(text, "cbgen_requests_waiting") == 0
    assert metric(text, "cbgen_kv_blocks_total") == NUM_BLOCKS
    assert metric(text, "cbgen_kv_blocks_used") == 0
    assert metric(text, "cbgen_generation_tokens_total") >= 4
    assert metric(text, "cbgen_time_to_first_token_seconds_count") >= 1
    assert metric(text, "cbgen_inter_token_latency_seconds_count") >= 3
    assert "# TYPE cbgen_time_to_first_token_seconds histogram" in text
    assert 'cbgen_time_to_first_token_seconds_bucket{le="+Inf"}' in text
    assert 'cbgen_requests_finished_total{finish_reason="length"}' in text
    assert 'cbgen_http_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_speculation_counts_reach_the_metrics():
    """A server with a layer-skip draft reports its guesses, and answers as it would
    without them (greedy)."""
    tokenizer = smollm2_tokenizer()
    model = tiny_model(tokenizer)
    spec = cbgen.SpeculativeConfig(method="layer_skip", num_layers=1)
    answers = []
    for speculative in (None, spec):
        config = cbgen.EngineConfig(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, speculative=speculative
        )
        engine = Engine(model, tokenizer, config)
        app = create_app(engine, tokenizer, MODEL)
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        try:
            with uvicorn_in_thread(uv) as base:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
                done = client.completions.create(
                    model=MODEL, prompt="Count: one two three", max_tokens=12, temperature=0
                )
                answers.append(done.choices[0].text)
                wait_idle(engine)
                text = httpx.get(f"{base}/metrics").text
        finally:
            engine.close()
    proposed = metric(text, "cbgen_spec_proposed_tokens_total")
    accepted = metric(text, "cbgen_spec_accepted_tokens_total")
    verifications = metric(text, "cbgen_spec_verifications_total")
    assert proposed > 0 and verifications > 0 and 0 <= accepted <= proposed
    mean = metric(text, "cbgen_spec_mean_accepted_length")
    assert mean == pytest.approx(1 + accepted / verifications)
    assert answers[0] == answers[1]


# -- errors ---------------------------------------------------------------------------------


def assert_error(exc_info, status, *words):
    exc = exc_info.value
    assert exc.status_code == status
    body = exc.body
    assert set(body) >= {"message", "type", "param", "code"}, body
    for word in words:
        assert word in body["message"], body


def test_bad_parameters(server):
    client = server.client
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, audio={"voice": "x"}, store=True)
    assert_error(e, 400, "audio", "store")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            **chat, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert_error(e, 400, "tools")
    # neutral values of unsupported parameters are fine
    client.chat.completions.create(**chat, presence_penalty=0, logprobs=False, user="u1")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y", best_of=3)
    assert_error(e, 400, "best_of", "suffix")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, temperature=5)
    assert_error(e, 400, "temperature")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, n=0)
    assert_error(e, 400, "n must be")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, extra_body={"top_k": -5})
    assert_error(e, 400, "top_k")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens="many")
    assert_error(e, 400, "max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    assert_error(e, 400, "vocabulary")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
    assert_error(e, 400, "text")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert_error(e, 404, "gpt-4")
    # the context limit: a prompt too long, or a prompt plus max_tokens too long
    long_prompt = list(range(1000, 1000 + CONTEXT))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert_error(e, 400, f"maximum context length is {CONTEXT}")
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=CONTEXT)
    assert_error(e, 400, "max_tokens")
    # bodies: too large (413), not JSON (400)
    big = {"model": MODEL, "prompt": "a" * (1 << 20), "max_tokens": 1}
    resp = server.http.post("/v1/completions", json=big, headers=server.auth)
    assert resp.status_code == 413 and "too large" in resp.json()["error"]["message"]

    def chunked(data):  # no content-length: the limit is enforced while reading
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    as_json = {**server.auth, "content-type": "application/json"}
    resp = server.http.post(
        "/v1/completions", content=chunked(json.dumps(big).encode()), headers=as_json
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    small = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    resp = server.http.post("/v1/completions", content=chunked(small), headers=as_json)
    assert resp.status_code == 200
    resp = server.http.post(
        "/v1/completions",
        content=b"{not json",
        headers={**server.auth, "content-type": "application/json"},
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = server.http.get("/v1/nothing", headers=server.auth)
    assert resp.status_code == 404 and "error" in resp.json()
    wait_idle(server.engine)


def test_api_key(server):
    wrong = openai.OpenAI(base_url=f"{server.base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert_error(e, 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    resp = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"
    resp = server.http.get("/v1/models", headers={"Authorization": "Basic " + API_KEY})
    assert resp.status_code == 401


# -- disconnects ----------------------------------------------------------------------------


def long_body(stream):
    return {
        "model": MODEL,
        "prompt": "A long story: " * 20,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


@contextlib.contextmanager
def hold_once_generating(engine, tokens):
    """Hold the online engine's loop before its next step, once a step has brought some
    request to ``tokens`` tokens, until the block ends (what that step made is published
    first). A seam of the test's own: the core's ``step`` wrapped on the instance."""
    core = engine.core
    reached, release = threading.Event(), threading.Event()

    def step():
        if reached.is_set():
            assert release.wait(60), "the test never let the engine go on"
        outputs = type(core).step(core)
        if any(len(out.token_ids) >= tokens for out in outputs):
            reached.set()
        return outputs

    core.step = step
    try:
        yield reached
    finally:
        release.set()
        del core.step


def test_disconnect_mid_stream_frees_blocks(server):
    engine = server.engine
    wait_idle(engine)
    before = metric(server.http.get("/metrics").text, "cbgen_client_disconnects_total")
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as http:
        # The loop is held once the stream has a few tokens: it cannot finish before the
        # client leaves, however fast the machine (400 tokens used to be the margin).
        with hold_once_generating(engine, tokens=4):
            with http.stream("POST", "/v1/completions", json=long_body(True)) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                while not next(lines).startswith("data: "):  # an event in: it holds blocks
                    pass
                assert engine.core.allocator.num_free < engine.core.allocator.num_blocks
            # leaving the blocks closes the connection mid-stream
    wait_idle(engine)
    after = metric(server.http.get("/metrics").text, "cbgen_client_disconnects_total")
    assert after == before + 1
    # The same for a plain (non-streamed) call whose client gives up. The engine's loop
    # is held inside a step meanwhile, so the call cannot finish first, however fast
    # the machine is (the test used to count on 400 tokens taking over 0.3 s).
    with hold_engine(engine):
        sock = socket.create_connection(("127.0.0.1", int(server.base.rsplit(":", 1)[1])))
        body = json.dumps(long_body(False)).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        until(lambda: engine.num_queued[0] == 2, "the call never reached the engine")
        sock.close()
        until(
            lambda: (
                metric(server.http.get("/metrics").text, "cbgen_client_disconnects_total")
                == before + 2
            ),
            "the disconnect was not noticed",
        )
    wait_idle(engine)
    text = server.http.get("/metrics").text
    assert metric(text, "cbgen_kv_blocks_used") == 0
    # and the server goes on serving
    r = server.client.completions.create(model=MODEL, prompt="Still here?", max_tokens=3)
    assert r.usage.completion_tokens == 3


def until(condition, message, timeout=60.0):
    """Poll ``condition`` (a failure guard, never a wait that must run out)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


def test_a_bad_value_fails_alone(server):
    """top_k 2**63 used to overflow in the batched sampler and fail every running request."""
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_body(True)) as victim:
            lines = victim.iter_lines()
            next(lines)
            bad = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 1.0}
            for field, value, word in [
                ("top_k", 2**63, "top_k"),
                ("seed", 2**64, "seed"),
                ("seed", -1, "seed"),
                ("priority", 2**40, "priority"),
                ("timeout", 0, "timeout"),
            ]:
                resp = http.post("/v1/completions", json={**bad, field: value})
                assert resp.status_code == 400, (field, resp.text)
                assert word in resp.json()["error"]["message"]
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finals[-1] == "length"
    wait_idle(server.engine)


def test_malformed_bodies_get_400(server):
    auth = {**server.auth, "content-type": "application/json"}
    resp = server.http.post("/v1/completions", content=b"[" * 100_000, headers=auth)
    assert resp.status_code == 400 and "nested" in resp.json()["error"]["message"]
    huge = b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
    resp = server.http.post("/v1/completions", content=huge, headers=auth)  # past 4,300 digits
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "temperature": 3},
        headers=server.auth,
    )
    error = resp.json()["error"]
    assert (resp.status_code, error["param"], error["type"]) == (
        400,
        "temperature",
        "invalid_request_error",
    )
    lone = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode()
    resp = server.http.post("/v1/completions", content=lone, headers=auth)
    assert resp.status_code == 400 and "tokenized" in resp.json()["error"]["message"]
    # a temperature that used to underflow to infinities: greedy, the same text
    kw = dict(model=MODEL, prompt="The sea", max_tokens=6)
    greedy = server.client.completions.create(**kw, temperature=0).choices[0].text
    tiny = server.client.completions.create(**kw, temperature=1e-40).choices[0].text
    assert tiny == greedy and tiny
    # a prompt longer than any tokenization could fit is refused before tokenizing
    chars = server.app_server.translator.max_prompt_chars + 1
    resp = server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "a" * chars, "max_tokens": 1},
        headers=server.auth,
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    wait_idle(server.engine)


def test_metrics_labels_come_from_a_fixed_set(server):
    size = len(server.http.get("/metrics").text)
    for i in range(50):  # unauthenticated calls to paths nobody serves
        assert server.http.get(f"/v1/random-{i}").status_code in (401, 404)
    text = server.http.get("/metrics").text
    assert len(text) < size + 2000, "the metrics grew with the paths clients made up"
    assert 'endpoint="other"' in text and "random-" not in text


def test_browser_requests_are_refused(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    as_text = {**server.auth, "content-type": "text/plain"}
    resp = server.http.post("/v1/completions", content=body, headers=as_text)
    assert resp.status_code == 415 and "application/json" in resp.json()["error"]["message"]
    evil = {**server.auth, "origin": "http://evil.example"}
    resp = server.http.post(
        "/v1/completions", content=body, headers={**evil, "content-type": "application/json"}
    )
    assert resp.status_code == 403 and "allowed-origins" in resp.json()["error"]["message"]


def test_queue_bounds_answer_429(server):
    engine = server.engine
    config = engine.config
    wait_idle(engine)
    config.max_waiting_requests = 2
    try:
        with hold_engine(engine):  # the holding request itself is the first waiting one
            with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as http:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as queued:
                    assert queued.status_code == 200
                    resp = http.post("/v1/completions", json={**body, "stream": False})
                    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
                    assert resp.json()["error"]["code"] == "server_overloaded"
                    engine_full = metric(
                        server.http.get("/metrics").text, "cbgen_requests_rejected_total"
                    )
                    assert engine_full >= 1
                    queued.close()
    finally:
        config.max_waiting_requests = None
    wait_idle(engine)
    # a server-wide cap on max_tokens
    server.app_server.translator.max_tokens_limit = 4
    try:
        resp = server.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 5},
            headers=server.auth,
        )
        assert resp.status_code == 400 and "at most 4" in resp.json()["error"]["message"]
        r = server.client.chat.completions.create(  # no max_tokens: the cap is the default
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 4
    finally:
        server.app_server.translator.max_tokens_limit = None


def test_cli_parses_serve():
    from cbgen.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "smollm2", "--api-key", "k"])
    assert (args.command, args.host, args.port, args.api_key) == ("serve", "127.0.0.1", 8000, "k")
    assert args.max_body_bytes == 1 << 20


# -- load -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_load_script_small():
    """bench/server_load.py end to end: `python -m cbgen serve` in a subprocess, 8 clients."""
    path = Path(__file__).resolve().parents[1] / "bench" / "server_load.py"
    spec = importlib.util.spec_from_file_location("server_load", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    smollm2_tokenizer()  # make sure the bundled tokenizer is converted (or skip)
    assert module.main(["--clients", "8", "--requests", "40", "--max-tokens", "24"]) == 0


# -- lifecycle: drain, slow and half-open connections ---------------------------------------


@contextlib.contextmanager
def own_server(engine, tokenizer, **options):
    """A key-less server of its own through ``make_server`` (drain, header timeout)."""
    from cbgen.frontends.server.lifecycle import make_server

    app_options = {k: options.pop(k) for k in ("allowed_origins",) if k in options}
    app = create_app(engine, tokenizer, MODEL, **app_options)
    uv = make_server(app, log_level="warning", **options)
    with uvicorn_in_thread(uv) as base:
        yield SimpleNamespace(uv=uv, base=base, app_server=app.state.cbgen)


@pytest.fixture(scope="module")
def spare_engine(server):
    engine = Engine(
        tiny_model(server.tokenizer),
        server.tokenizer,
        cbgen.EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        stream_timeout=0.5,
    )
    yield engine
    engine.close()


def test_sigterm_drains_then_ends_streams(server, spare_engine):
    engine = spare_engine
    # The drain's time cannot run out by itself here (the test ends it with end_drain),
    # so /health is asked while it surely still runs, however slow the machine is.
    with own_server(engine, server.tokenizer, drain_timeout=3600) as srv:
        base = srv.base
        with httpx.Client(base_url=base, timeout=60) as http:
            assert http.get("/health").json()["status"] == "ok"
            # without a key, only loopback Host names are served (DNS rebinding)
            resp = http.get("/v1/models", headers={"host": "evil.example"})
            assert resp.status_code == 403
            with hold_engine(engine):  # the stream cannot finish while the drain runs
                with http.stream("POST", "/v1/completions", json=long_body(True)) as resp:
                    assert resp.status_code == 200
                    srv.uv.handle_exit(signal.SIGTERM, None)
                    until(lambda: srv.app_server.draining, "no drain")
                    with httpx.Client(base_url=base, timeout=60) as other:
                        assert other.get("/health").json()["status"] == "draining"
                    srv.uv.end_drain()  # as if drain_timeout had passed: streams end
                    events = [line for line in resp.iter_lines() if line]
            assert events[-1] == "data: [DONE]"
            assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        until(lambda: srv.uv.should_exit, "the server did not exit after the drain")
    wait_idle(engine)


def test_half_sent_connections_are_closed(server, spare_engine):
    engine = spare_engine
    with own_server(engine, server.tokenizer, header_timeout=0.2) as srv:
        # a request head that never completes: the server hangs up
        half = socket.create_connection(("127.0.0.1", int(srv.base.rsplit(":", 1)[1])))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        half.settimeout(60)
        assert half.recv(1024) == b""
        half.close()
    # a whole head, then a body that never comes: 408 once the body timeout passes
    app = create_app(engine, server.tokenizer, MODEL, body_timeout=0.2)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with uvicorn_in_thread(uv) as base:
        slow = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
        )
        slow.settimeout(60)
        answer = b""
        while chunk := slow.recv(4096):  # the server closes the connection after it
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        slow.close()
    wait_idle(engine)


def test_a_stream_whose_writes_stall_is_closed(server, spare_engine):
    """A client that stops reading fills the socket buffers and the server's writes wait;
    past stream_timeout (0.5 s here) the stream is closed and its requests cancelled.
    Driven at the ASGI level with a send that never returns once the stream has begun."""
    engine = spare_engine
    app = create_app(engine, server.tokenizer, MODEL)
    app_server = app.state.cbgen
    body = json.dumps({**long_body(True), "n": 4}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def main():
        stalled = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never disconnects

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                stalled.set()
                await asyncio.Event().wait()  # a write that never goes through

        await asyncio.wait_for(app(scope, receive, send), 60)  # a failure guard only
        assert stalled.is_set()

    before = metric(app_server.metrics.render().decode(), "cbgen_client_disconnects_total")
    asyncio.run(main())
    assert not app_server.jobs
    after = metric(app_server.metrics.render().decode(), "cbgen_client_disconnects_total")
    assert after == before + 1
    wait_idle(engine)


class _SlowTokenizer:
    """The real tokenizer, except that encoding waits until the test releases it."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(60)
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_tokenizing_never_blocks_the_event_loop(server, spare_engine):
    """A prompt being encoded (a 1 MB prompt took 1.6-2 s) must not freeze other clients."""
    slow = _SlowTokenizer(server.tokenizer)
    app = create_app(spare_engine, slow, MODEL)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with uvicorn_in_thread(uv) as base, httpx.Client(base_url=base, timeout=60) as http:
        result = {}
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
        call = threading.Thread(
            target=lambda: result.setdefault("r", http.post("/v1/completions", json=body))
        )
        call.start()
        try:
            assert slow.entered.wait(60)  # the call is inside the tokenizer now
            with httpx.Client(base_url=base, timeout=60) as other:
                assert other.get("/health").status_code == 200  # the loop still answers
                assert other.get("/v1/models").status_code == 200
        finally:
            slow.release.set()
            call.join(60)
        assert result["r"].status_code == 200
    wait_idle(spare_engine)


def test_a_wide_call_yields_to_a_small_one(server):
    """An n=8 call used to hold every slot until it finished (a 3-token call waited past
    90 s behind n=128 x 1,500 tokens); its choices past the fair share now run one priority
    lower, so the small call preempts one of them and starts at once."""
    engine = Engine(
        tiny_model(server.tokenizer),
        server.tokenizer,
        # room for every choice: any preemption is for priority, not for memory
        cbgen.EngineConfig(num_blocks=256, block_size=BLOCK_SIZE, max_num_seqs=4),
    )
    app = create_app(engine, server.tokenizer, MODEL, fair_share_choices=2)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        with uvicorn_in_thread(uv) as base, httpx.Client(base_url=base, timeout=60) as http:
            wide = {**long_body(True), "n": 8, "max_tokens": 300}
            with http.stream("POST", "/v1/completions", json=wide) as resp:
                lines = resp.iter_lines()
                next(lines)  # it runs: four choices hold all four slots
                small = {"model": MODEL, "prompt": "Quick", "max_tokens": 3, "ignore_eos": True}
                r = http.post("/v1/completions", json=small)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
                # it did not wait for a slot: it preempted one of the wide call's choices
                assert engine.core.stats["preemptions"] >= 1
                assert len(app.state.cbgen.jobs) == 1  # the wide call still runs
        wait_idle(engine)
    finally:
        engine.close()


def nested_schema(depth):
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, ["nonsense"]),
        ("guided_json", {"type": 5}, ["type"]),
        ("guided_regex", "([a-z", ["regex", "unclosed"]),
        ("guided_grammar", "root ::= (", ["grammar"]),
        ("guided_json", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}, ["too large"]),
        ("guided_json", nested_schema(200), ["recursion"]),
    ],
)  # fmt: skip
def test_structured_specs_that_cannot_compile_are_400(server, field, value, words):
    """Each spec is compiled while the call is checked: a 400 naming the field, never a
    500 from a request that failed in the engine."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    for path, key in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        if key == "messages":
            body = {**body, "messages": [{"role": "user", "content": "hi"}]}
            body.pop("prompt")
        resp = server.http.post(path, json=body, headers=server.auth)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), error
        for word in words:
            assert word in error["message"], error
    wait_idle(server.engine)


def test_a_bad_spec_fails_the_online_engines_add_request(server):
    params = cbgen.SamplingParams(
        max_new_tokens=2, structured_output=cbgen.StructuredOutput(regex="([a-z")
    )
    with pytest.raises(ValueError, match="unclosed"):
        server.engine.add_request([5, 6, 7], params)


def test_a_timed_out_call_finishes_with_an_openai_reason(server):
    """``finish_reason`` takes OpenAI's values only; the timeout shows in ``finish_detail``."""
    body = {**long_body(False), "timeout": 1e-9}
    resp = server.http.post("/v1/completions", json=body, headers=server.auth)
    choice = resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["finish_detail"]) == ("length", "timeout")
    with server.http.stream(
        "POST", "/v1/chat/completions", headers=server.auth,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
              "stream": True, "timeout": 1e-9},
    ) as resp:  # fmt: skip
        chunks = [json.loads(e[6:]) for e in resp.iter_lines() if e and e != "data: [DONE]"]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["finish_detail"]) == ("length", "timeout")
    plain = server.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "finish_detail" not in plain.choices[0].model_dump(exclude_unset=True)
    wait_idle(server.engine)


def test_a_client_with_many_calls_yields_to_one_with_few(server):
    """Per client (a call's ``user``, or its API key when there are several), requests
    past the client's share of unfinished ones run one priority lower."""
    engine = Engine(
        tiny_model(server.tokenizer),
        server.tokenizer,
        cbgen.EngineConfig(num_blocks=256, block_size=BLOCK_SIZE),
    )
    keys = ["key-a", "key-b"]
    app = create_app(engine, server.tokenizer, MODEL, api_key=keys, client_fair_share=2)
    added: list[int] = []
    add = engine.add_request

    def recording(prompt, params=None, request_id=None, **options):  # a seam of the test's
        added.append(params.priority)
        return add(prompt, params, request_id, **options)

    engine.add_request = recording
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        with uvicorn_in_thread(uv) as base, httpx.Client(base_url=base, timeout=60) as http:

            def open_call(stack, key, **fields):
                body = {**long_body(True), "max_tokens": 50, **fields}
                headers = {"Authorization": f"Bearer {key}"}
                resp = stack.enter_context(
                    http.stream("POST", "/v1/completions", json=body, headers=headers)
                )
                assert resp.status_code == 200
                return added[-fields.get("n", 1) :]

            with contextlib.ExitStack() as stack, hold_engine(engine):
                # alice's third request is past her share; bob's first is not
                assert [open_call(stack, "key-a", user="alice") for _ in range(3)] == [
                    [0],
                    [0],
                    [1],
                ]
                assert open_call(stack, "key-a", user="bob") == [0]
                assert open_call(stack, "key-a", user="alice", n=2) == [1, 1]
                # no user: the key names the client
                assert [open_call(stack, "key-b") for _ in range(3)] == [[0], [0], [1]]
                assert open_call(stack, "key-a") == [0]
                calls = app.state.cbgen.calls
                assert calls.in_flight == {"user:alice": 5, "user:bob": 1, "key:1": 3, "key:0": 1}
            wait_idle(engine)  # the streams closed: their requests were cancelled
            assert calls.in_flight == {}
            done = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "alice"},
                headers={"Authorization": "Bearer key-a"},
            )
            assert done.status_code == 200 and added[-1] == 0 and calls.in_flight == {}
    finally:
        engine.close()
