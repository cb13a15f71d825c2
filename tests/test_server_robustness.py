"""The server under abuse: fuzzed request bodies and misbehaving clients under load.

A real uvicorn server of this module's own (in a thread, on a free port) serves the same
tiny random Llama with SmolLM2's tokenizer as ``test_server.py``. Whatever a client sends,
the answer is a 2xx or a 4xx, never a 5xx, and streams that other clients run meanwhile
are not disturbed; however clients behave, every KV block comes back.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_server import (  # noqa: E402
    API_KEY,
    CONTEXT,
    MODEL,
    metric,
    smollm2_tokenizer,
    tiny_model,
    uvicorn_in_thread,
    wait_idle,
)

import cbgen  # noqa: E402
from cbgen.frontends.online import Engine  # noqa: E402
from cbgen.frontends.server import create_app  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GUARD_S = 120.0  # failure guards only: nothing here waits for a deadline to pass

# Loggers whose errors mean the server failed somewhere a status code does not show
# (an exception inside a stream after its 200, a task that died, a crashed handler).
WATCHED_LOGGERS = ("cbgen", "uvicorn", "uvicorn.error", "asyncio", "fastapi", "starlette")


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, start: int = 0) -> str:
        """The records from ``start`` on, with their tracebacks."""
        fmt = logging.Formatter("%(name)s %(levelname)s: %(message)s")
        return "\n".join(fmt.format(r) for r in self.records[start:])


@pytest.fixture(scope="module")
def robust():
    tokenizer = smollm2_tokenizer()
    engine = Engine(
        tiny_model(tokenizer), tokenizer, cbgen.EngineConfig(num_blocks=128, block_size=16)
    )
    # the tools' template, so tool_choice "auto" runs its parser on the tiny model's text
    tokenizer.chat_template = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
    app = create_app(
        engine, tokenizer, MODEL, api_key=API_KEY, tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )  # fmt: skip
    errors = _ErrorLog()
    for name in WATCHED_LOGGERS:
        logging.getLogger(name).addHandler(errors)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    try:
        with uvicorn_in_thread(uv) as base, httpx.Client(base_url=base, timeout=GUARD_S) as http:
            yield SimpleNamespace(
                base=base,
                engine=engine,
                tokenizer=tokenizer,
                http=http,
                app_server=app.state.cbgen,
                errors=errors,
            )
    finally:
        engine.close()
        for name in WATCHED_LOGGERS:
            logging.getLogger(name).removeHandler(errors)


def assert_all_free(srv) -> None:
    """Nothing runs, waits or is queued, and every KV block is back (evictable counts)."""
    engine = srv.engine
    wait_idle(engine, timeout=GUARD_S)
    assert engine.num_queued == (0, 0)
    assert not srv.app_server.jobs
    # The snapshot behind /metrics is published right after each step, a moment after
    # the step's results reach their clients: poll (a failure guard, never a wait that
    # must run out) rather than read it once.
    deadline = time.monotonic() + GUARD_S
    while True:
        used = metric(srv.http.get("/metrics").text, "cbgen_kv_blocks_used")
        snap = engine.snapshot()
        if used == 0 and (snap.running, snap.waiting) == (0, 0):
            break
        assert time.monotonic() < deadline, f"{used} blocks used in /metrics; {snap}"
        time.sleep(0.01)


def read_sse(lines) -> list[str]:
    """The ``data:`` payloads of a stream of SSE lines."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        events.append(line[6:])
    return events


def check_stream(events: list[str], max_tokens: int) -> None:
    """A whole, undisturbed greedy stream: every choice ran to ``max_tokens``."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finals == ["length"], finals
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == max_tokens, usage


# -- 1. fuzzing ---------------------------------------------------------------------------

VICTIM_TOKENS = 200

HUGE_INTS = [2**31, 2**31 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**70)]
ODD_FLOATS = [1e-40, 5e-324, 1e-300, 1e308, -0.0, 0.5, 2.0000001, math.inf, -math.inf, math.nan]
ODD_TEXTS = ["\ud800", "a\udfffb", "", " ", "\x00", "<|im_start|>", "<|endoftext|>", "\U0001f600"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE_INTS)
    | st.floats()  # nan and infinities too: Python's json reads NaN and Infinity
    | st.sampled_from(ODD_FLOATS)
    | st.text(max_size=12)
    | st.sampled_from(ODD_TEXTS)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(ODD_TEXTS), inner, max_size=4)
    ),
    max_leaves=12,
)
small_text = st.text(max_size=24) | st.sampled_from(ODD_TEXTS + ["Once upon a time", "Hello"])
VOCAB = 49152  # SmolLM2's vocabulary (the fuzzing test checks it)
token_ids = st.integers(0, VOCAB - 1) | st.sampled_from(
    [-1, VOCAB, VOCAB + 1, 10**9, 2**63, -(2**64)]
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
NESTED_SCHEMA: dict = {"type": "object"}
for _ in range(200):
    NESTED_SCHEMA = {"type": "object", "properties": {"a": NESTED_SCHEMA}}
BAD_FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}}},
]  # fmt: skip

# Each field: values a client would send, and values a careless or hostile one might.
# Junk max_tokens / n never ask for much work when they happen to be valid.
VALID = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2, 1e-40, 1e-5]),
    "top_p": st.sampled_from([1, 1.0, 0.9, 1e-300, 5e-324]),
    "top_k": st.sampled_from([0, -1, 1, 40, VOCAB, VOCAB + 1, 2**62, 2**63 - 1]),
    "n": st.integers(1, 3),
    "seed": st.sampled_from([None, 0, 7, 2**63, 2**64 - 1, 2**64 - 2]),
    "stop": st.none() | small_text.filter(bool) | st.lists(small_text.filter(bool), max_size=3),
    "stream": st.booleans(),
    "priority": st.sampled_from([0, -1, 5, 2**31, -(2**31)]),
    "timeout": st.sampled_from([None, 60, 1e-9, 5e-324, 1e308, math.inf]),
    "ignore_eos": st.booleans(),
    "logprobs": st.none(),
    "user": small_text,
    # tools and structured output, valid or not (a spec that cannot compile is a 400)
    "tools": st.sampled_from([None, [WEATHER_TOOL], [WEATHER_TOOL, TIME_TOOL]]),
    "tool_choice": st.sampled_from(
        [None, "none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}]
    ),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from(BAD_FORMATS + [None, {"type": "json_object"}]),
    "guided_regex": st.sampled_from([None, "[a-z]{1,4}", "([a-z", "\\"]),
    "guided_grammar": st.sampled_from([None, "root ::= (", 'root ::= "a" | "b"', "start:"]),
    "guided_json": st.sampled_from([None, {"type": 5}, {"type": "object"}, NESTED_SCHEMA]),
}
JUNK = {
    "model": st.sampled_from(["gpt-4", "", MODEL + " ", MODEL.upper(), "\ud800", None, 3])
    | json_values,
    "max_tokens": st.sampled_from(
        [0, -1, CONTEXT, CONTEXT + 1, 10**6, 1.5, 8.0, "8", "many", True, [], {}, math.nan]
        + HUGE_INTS
    ),
    "temperature": json_values,
    "top_p": json_values,
    "top_k": json_values,
    "n": st.sampled_from([0, -1, 10**6, 129, 1.5, "2", True, None, math.inf] + HUGE_INTS),
    "seed": json_values,
    "stop": json_values | st.lists(small_text, min_size=15, max_size=20),
    "stream": json_values,
    "priority": json_values,
    "timeout": json_values,
    "ignore_eos": json_values,
    "logprobs": json_values,
    "user": json_values,
    "tools": json_values
    | st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": small_text}, optional={"parameters": json_values}
                ),
            }
        ),
        max_size=2,
    ),
    "tool_choice": json_values,
    "parallel_tool_calls": json_values,
    "response_format": json_values,
    "guided_regex": json_values,
    "guided_grammar": json_values,
    "guided_json": json_values,
}
UNKNOWN_FIELDS = ["tools", "echo", "best_of", "suffix", "logit_bias", "presence_penalty",
                  "response_format", "stream_options", "max_completion_tokens", "functions",
                  "top_logprobs", "x-unknown", "", "\ud800"]  # fmt: skip

prompts = (
    small_text
    | st.lists(token_ids, max_size=12)
    | st.lists(small_text, max_size=3)
    | st.lists(st.lists(token_ids, max_size=6), max_size=3)
    | st.sampled_from([[], [[]], [""], "", [1, "a"], ["a", 1], {"text": "hi"}, None])
    | json_values
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": small_text}
)
messages = st.lists(message, min_size=1, max_size=3) | st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "tool", "function", "", "\ud800"]) | json_values,
            "content": small_text
            | st.none()
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""])})
                | st.fixed_dictionaries({"type": st.just("text"), "text": json_values}),
                max_size=3,
            )
            | json_values,
        },
        optional={"name": json_values, "tool_calls": json_values, "refusal": json_values},
    ),
    max_size=3,
)


@st.composite
def fuzzed_body(draw, chat: bool):
    """A mostly valid request with a few fields (sometimes none) set to junk."""
    fields = list(VALID)
    junk = draw(st.sets(st.sampled_from(fields), max_size=2))
    body = {}
    for name in fields:
        if name != "model" and name not in junk and not draw(st.booleans()):
            continue  # leave the optional field out
        body[name] = draw(JUNK[name] if name in junk else VALID[name])
    body["max_tokens"] = body.get("max_tokens", draw(VALID["max_tokens"]))
    if chat:
        body["messages"] = draw(message.map(lambda m: [m]) | messages)
        if draw(st.booleans()):  # the newer name for the same bound
            body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = draw(st.sampled_from(["The quick brown fox", [504, 2365, 6354]]) | prompts)
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = draw(
            st.just({"include_usage": True}) | st.just({"include_usage": False}) | json_values
        )
    for name in draw(st.lists(st.sampled_from(UNKNOWN_FIELDS), max_size=2)):
        body[name] = draw(json_values)
    return body


# Raw bodies; in those shaped like a request, <input> stands for the endpoint's input
# (a prompt or messages) and <model> for the model's name.
RAW_BODIES = [
    b"[" * 100_000,
    b"{" * 100_000,
    b'{"a":' * 50_000,
    b"[" * 1000 + b"]" * 1000,
    b"",
    b"null",
    b"{}",
    b"[]",
    b"\xff\xfe\x00",
    b"\xef\xbb\xbf{}",
    b'{"model": "<model>", <input>, "max_tokens": 2, "temperature": NaN}',
    b'{"model": "<model>", <input>, "max_tokens": 1e400}',
    b'{"model": "<model>", <input>, "max_tokens": -Infinity}',
    b'{"model": "<model>", <input>, "max_tokens": 2, "n": 1, "n": 2}',
    b'{"model": "<model>", <input>, "max_tokens": 2, "timeout": Infinity}',
    # integers past Python's int/str conversion limit (4300 digits)
    b'{"model": "<model>", <input>, "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "<model>", <input>, "max_tokens": 2, "seed": -' + b"1" * 4301 + b"}",
]
RAW_INPUTS = {
    "/v1/completions": [
        b'"prompt": "hi"',
        b'"prompt": "a\\ud800b"',
        b'"prompt": [1' + b"0" * 5000 + b"]",
    ],
    "/v1/chat/completions": [
        b'"messages": [{"role": "user", "content": "hi"}]',
        b'"messages": [{"role": "user", "content": "a\\udfffb"}]',
    ],
}
PATHS = list(RAW_INPUTS)


def raw_body(template: bytes, path: str, index: int = 0) -> bytes:
    inputs = RAW_INPUTS[path]
    return template.replace(b"<model>", MODEL.encode()).replace(
        b"<input>", inputs[index % len(inputs)]
    )


# Every raw body on both endpoints, with each input: always run, before the random ones.
RAW_EXAMPLES = sorted(
    {
        (path, raw_body(template, path, i), "application/json")
        for path in PATHS
        for template in RAW_BODIES
        for i in range(len(RAW_INPUTS[path]))
    }
) + [(path, raw_body(RAW_BODIES[10], path), "text/plain") for path in PATHS]


CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "text/plain",
    "application/x-www-form-urlencoded",
    "",
]


@st.composite
def fuzzed_call(draw):
    """(path, content bytes, content type): a JSON body or raw bytes."""
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["fuzzed"] * 6 + ["arbitrary", "raw"]))
    if kind == "raw":
        template = draw(st.sampled_from(RAW_BODIES))
        content = raw_body(template, path, draw(st.integers(0, 2)))
        return path, content, draw(st.sampled_from(CONTENT_TYPES))
    body = draw(
        json_values if kind == "arbitrary" else fuzzed_body(path.endswith("chat/completions"))
    )
    # ensure_ascii (the default) writes lone surrogates as \ud800 escapes; allow_nan
    # writes NaN and Infinity, which Python's json (the server's) reads.
    content = json.dumps(body).encode()
    return path, content, "application/json"


def describe(path, content) -> str:
    shown = content if len(content) < 2000 else content[:200] + b"...(%d bytes)" % len(content)
    return f"POST {path} {shown!r}"


class Victims:
    """Greedy streams that run back to back, each in its own thread, while fuzzing goes on."""

    def __init__(self, base: str, count: int) -> None:
        self.base = base
        self.stop = threading.Event()
        self.started = [threading.Event() for _ in range(count)]
        self.results: list[tuple[int, Exception | None]] = []
        self.seconds: list[float] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(count)
        ]

    def body(self, i: int) -> dict:
        common = {
            "model": MODEL,
            "max_tokens": VICTIM_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if i % 2:
            return {**common, "messages": [{"role": "user", "content": "Tell me a story."}]}
        return {**common, "prompt": "A long story about a victim stream: "}

    def run(self, i: int) -> None:
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        with httpx.Client(base_url=self.base, headers=AUTH, timeout=GUARD_S) as http:
            while True:
                error = None
                t0 = time.monotonic()
                try:
                    with http.stream("POST", path, json=self.body(i)) as resp:
                        assert resp.status_code == 200, resp.read()
                        lines = resp.iter_lines()
                        first = next(lines)
                        self.started[i].set()
                        events = read_sse([first, *lines])
                    check_stream(events, VICTIM_TOKENS)
                except Exception as exc:  # reported by the test
                    error = exc
                with self.lock:
                    self.results.append((i, error))
                    self.seconds.append(time.monotonic() - t0)
                if error is not None or self.stop.is_set():
                    self.started[i].set()
                    return

    def __enter__(self) -> Victims:
        for thread in self.threads:
            thread.start()
        for event in self.started:  # each victim is in the engine before fuzzing starts
            assert event.wait(GUARD_S), "a victim stream never started"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(GUARD_S)
        assert not any(t.is_alive() for t in self.threads), "a victim stream hung"


def test_fuzzed_bodies_never_break_the_server(robust):
    assert len(robust.tokenizer) == VOCAB
    t0 = time.monotonic()
    seen: dict[int, int] = {}
    robust.errors.records.clear()
    with (
        httpx.Client(base_url=robust.base, timeout=GUARD_S) as http,
        Victims(robust.base, 2) as victims,
    ):

        def fuzz(call):
            path, content, ctype = call
            # a connection per call: a call the server hangs up on fails alone
            headers = {**AUTH, "connection": "close"}
            if ctype:
                headers["content-type"] = ctype
            logged = len(robust.errors.records)
            resp = http.post(path, content=content, headers=headers)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (
                f"{describe(path, content)} -> {resp.status_code} {resp.text}\n"
                f"server log:\n{robust.errors.text(logged)}"
            )
            if resp.status_code == 200:  # a whole answer, and no error hidden in a stream
                if resp.headers["content-type"].startswith("text/event-stream"):
                    events = read_sse(resp.text.splitlines())
                    assert events[-1] == "[DONE]", (describe(path, content), events[-3:])
                    bad = [e for e in events[:-1] if "error" in json.loads(e)]
                    assert not bad, (describe(path, content), bad)
                else:
                    answer = resp.json()
                    assert answer["choices"] and answer["usage"], answer
            else:
                assert "error" in resp.json(), resp.text
            assert len(robust.errors.records) == logged, (
                f"{describe(path, content)}\nserver log:\n{robust.errors.text(logged)}"
            )

        fuzz = given(call=fuzzed_call())(fuzz)
        for call in reversed(RAW_EXAMPLES):
            fuzz = example(call=call)(fuzz)
        settings(
            max_examples=60,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )(fuzz)()
    failed = [(i, e) for i, e in victims.results if e is not None]
    print(
        f"\nfuzzing: {sum(seen.values())} calls, statuses {dict(sorted(seen.items()))}, "
        f"{len(victims.results)} victim streams of {VICTIM_TOKENS} tokens "
        f"({', '.join(f'{s:.1f}' for s in victims.seconds)} s), {time.monotonic() - t0:.1f} s"
    )
    assert not failed, failed
    assert len(victims.results) >= 2
    assert not robust.errors.records, robust.errors.text()
    assert_all_free(robust)


# -- 2. load with misbehaving clients -----------------------------------------------------

CLIENTS = 64
LOAD_TOKENS = 48
# The bound on the process's RSS growth over one round: 300 MiB. A first round measured
# +70 to +120 MiB on 2 cores (native: oneDNN's per-shape primitive cache and the
# allocators warming to new batch shapes; Python's own objects do not grow), while a
# leak of 5 MiB per call (320 MiB over the 64) would fail.
RSS_GROWTH_LIMIT_MIB = 300


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_load_with_misbehaving_clients(robust):
    robust.errors.records.clear()
    # warm up: the first calls of a fresh process allocate what every later call reuses
    for path, extra in [
        ("/v1/completions", {"prompt": "warm up"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}]}),
    ]:
        resp = robust.http.post(
            path, json={"model": MODEL, "max_tokens": 4, "stream": True, **extra}, headers=AUTH
        )
        assert resp.status_code == 200
    assert_all_free(robust)
    rss_before = rss_mib()
    stats = robust.engine.core.stats
    decoded_before, preempted_before = stats.get("decode_tokens", 0), stats.get("preemptions", 0)
    t0 = time.monotonic()

    readers_done = threading.Event()
    outcomes: list[tuple[int, str, Exception | None]] = []
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=CLIENTS)

    def client(i: int, http: httpx.Client) -> None:
        role = ("silent", "quitter", "reader", "reader")[i % 4]
        chat = (i // 4) % 2 == 1
        body = {
            "model": MODEL,
            "max_tokens": LOAD_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": f"Client {i}: tell me a story."}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = f"Client {i} says: once upon a time"
            path = "/v1/completions"
        error = None
        try:
            with http.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200, resp.read()
                if role == "silent":  # headers only; the body is never read
                    assert readers_done.wait(GUARD_S), "the readers never finished"
                elif role == "quitter":  # a few events, then hang up
                    lines = resp.iter_lines()
                    got = 0
                    while got < 3:
                        got += bool(next(lines))
                else:
                    check_stream(read_sse(resp.iter_lines()), LOAD_TOKENS)
        except Exception as exc:  # reported by the test
            error = exc
        with lock:
            outcomes.append((i, role, error))

    with httpx.Client(base_url=robust.base, headers=AUTH, timeout=GUARD_S, limits=limits) as http:
        threads = [
            threading.Thread(target=client, args=(i, http), daemon=True) for i in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        talkers = [t for i, t in enumerate(threads) if i % 4 != 0]
        silent = [t for i, t in enumerate(threads) if i % 4 == 0]
        try:
            for thread in talkers:
                thread.join(GUARD_S)
            assert not any(t.is_alive() for t in talkers), "a client hung"
            served = time.monotonic() - t0
        finally:
            readers_done.set()  # now the silent ones close their streams
            for thread in silent:
                thread.join(GUARD_S)
        assert not any(t.is_alive() for t in silent), "a silent client hung"
    assert_all_free(robust)
    rss_after = rss_mib()
    elapsed = time.monotonic() - t0
    disconnects = metric(robust.http.get("/metrics").text, "cbgen_client_disconnects_total")
    print(
        f"\nload: {CLIENTS} clients x {LOAD_TOKENS} tokens; readers served in {served:.1f} s, "
        f"all done in {elapsed:.1f} s; RSS {rss_before:.0f} -> {rss_after:.0f} MiB "
        f"(+{rss_after - rss_before:.0f}); {stats.get('decode_tokens', 0) - decoded_before} "
        f"tokens decoded, {stats.get('preemptions', 0) - preempted_before} preemptions, "
        f"{disconnects:.0f} disconnects counted so far"
    )
    failed = [(i, role, e) for i, role, e in outcomes if e is not None]
    assert not failed, failed
    assert len(outcomes) == CLIENTS
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MIB
    assert not robust.errors.records, robust.errors.text()
    # and the server goes on serving
    resp = robust.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Still here?", "max_tokens": 3, "ignore_eos": True},
        headers=AUTH,
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert_all_free(robust)
