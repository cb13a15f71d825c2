"""The OpenAI-compatible server, driven over loopback with the official ``openai`` client.

One real uvicorn server (in a thread, on a free port) serves a tiny random Llama with
SmolLM2's tokenizer and full vocabulary, so text, chat templates and stop strings are
real while every step stays cheap.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import cbgen  # noqa: E402
from cbgen.online import Engine  # noqa: E402
from cbgen.server import create_app  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny-smollm2"
NUM_BLOCKS = 64
BLOCK_SIZE = 16
CONTEXT = 512


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    folder = cbgen.models.cache_dir() / "smollm2"
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
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(
            base=base,
            engine=engine,
            tokenizer=tokenizer,
            client=openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60),
            http=httpx.Client(base_url=base, timeout=60),
            auth={"Authorization": f"Bearer {API_KEY}"},
        )
    finally:
        uv.should_exit = True
        thread.join(30)
        engine.close()
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
        client.chat.completions.create(**chat, logprobs=True, presence_penalty=0.5)
    assert_error(e, 400, "logprobs", "presence_penalty")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            **chat, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert_error(e, 400, "tools")
    # neutral values of unsupported parameters are fine
    client.chat.completions.create(**chat, presence_penalty=0, logprobs=False, user="u1")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, best_of=3)
    assert_error(e, 400, "best_of", "echo")
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


def test_disconnect_mid_stream_frees_blocks(server):
    engine = server.engine
    wait_idle(engine)
    before = metric(server.http.get("/metrics").text, "cbgen_client_disconnects_total")
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_body(True)) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(6):  # a few events in: the request holds blocks
                next(lines)
            assert engine.core.allocator.num_free < engine.core.allocator.num_blocks
        # leaving the blocks closes the connection mid-stream
    wait_idle(engine)
    after = metric(server.http.get("/metrics").text, "cbgen_client_disconnects_total")
    assert after == before + 1
    # the same for a plain (non-streamed) call whose client gives up
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=long_body(False))
    wait_idle(engine)
    text = server.http.get("/metrics").text
    assert metric(text, "cbgen_client_disconnects_total") == before + 2
    assert metric(text, "cbgen_kv_blocks_used") == 0
    # and the server goes on serving
    r = server.client.completions.create(model=MODEL, prompt="Still here?", max_tokens=3)
    assert r.usage.completion_tokens == 3


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
