"""LoRA adapters through the OpenAI-compatible server: ``--lora-modules``, the request's
``model`` picking the adapter, ``/v1/models``, and run-time loading (off by default)."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from conftest import reference_greedy
from test_lora import make_adapter
from test_server import smollm2_tokenizer, tiny_model, uvicorn_in_thread

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import cbgen  # noqa: E402
from cbgen.frontends.online import Engine  # noqa: E402
from cbgen.frontends.server import create_app  # noqa: E402

API_KEY = "lora-key"
MODEL = "tiny-base"
PROMPT = [1, 330, 2114, 282, 253, 1789, 30, 198]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = smollm2_tokenizer()
    base = tiny_model(tokenizer)
    adapters = {}
    for index, name in enumerate(["math", "code", "spare"]):
        model = make_adapter(base, 40 + index, r=4, lora_alpha=8, target_modules="all-linear")
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        adapters[name] = (str(folder), model)
    return SimpleNamespace(tokenizer=tokenizer, base=base, adapters=adapters)


@pytest.fixture(scope="module")
def server(setup):
    engine = Engine(
        copy.deepcopy(setup.base),
        setup.tokenizer,
        cbgen.EngineConfig(num_blocks=64, block_size=16, max_loras=2),
    )
    modules = {name: setup.adapters[name][0] for name in ("math", "code")}
    app = create_app(
        engine,
        setup.tokenizer,
        MODEL,
        api_key=API_KEY,
        lora_modules=modules,
        enable_lora_runtime_updates=True,
    )
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    try:
        with uvicorn_in_thread(uv) as base:
            yield SimpleNamespace(
                base=base,
                engine=engine,
                client=openai.OpenAI(
                    base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60
                ),
                http=httpx.Client(
                    base_url=base, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
                ),
            )
    finally:
        engine.close()


def _expected(setup, model, max_tokens=8) -> str:
    reference = setup.base if model == MODEL else setup.adapters[model][1]
    ids = reference_greedy(reference, PROMPT, max_tokens)
    return setup.tokenizer.decode(ids, skip_special_tokens=True)


def _complete(server, model, stream=False, max_tokens=8) -> str:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    if stream:
        chunks = server.client.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    response = server.client.completions.create(**kwargs)
    assert response.model == model
    return response.choices[0].text


def test_the_model_field_picks_the_adapter(server, setup):
    texts = {model: _expected(setup, model) for model in (MODEL, "math", "code")}
    assert len(set(texts.values())) == 3, "the adapters must change the output"
    for model, text in texts.items():
        assert _complete(server, model) == text
        assert _complete(server, model, stream=True) == text


def test_adapters_mixed_in_concurrent_calls(server, setup):
    models = [MODEL, "math", "code"] * 4
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda m: _complete(server, m), models))
    assert texts == [_expected(setup, m) for m in models]


def test_chat_under_an_adapter(server, setup):
    response = server.client.chat.completions.create(
        model="math",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
    )
    assert response.model == "math"
    prompt = setup.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    ids = reference_greedy(setup.adapters["math"][1], list(prompt), 4)
    assert response.choices[0].message.content == setup.tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_streamed_chat_under_an_adapter_names_it(server, setup):
    messages = [{"role": "user", "content": "Hi"}]
    chunks = list(
        server.client.chat.completions.create(
            model="code", messages=messages, max_tokens=4, temperature=0, stream=True
        )
    )
    assert {chunk.model for chunk in chunks} == {"code"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = setup.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = reference_greedy(setup.adapters["code"][1], list(prompt), 4)
    assert text == setup.tokenizer.decode(ids, skip_special_tokens=True)


def test_models_lists_base_and_adapters(server, setup):
    data = server.client.models.list().data
    assert [m.id for m in data] == [MODEL, "math", "code"]
    base = data[0].model_dump()
    assert "parent" not in base and "root" not in base
    for model in data[1:]:
        card = model.model_dump()
        assert card["parent"] == MODEL and card["root"] == setup.adapters[model.id][0]


def test_an_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert "'math'" in caught.value.body["message"]


def test_load_and_unload_at_run_time(server, setup):
    spare = setup.adapters["spare"][0]
    no_key = httpx.post(f"{server.base}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert no_key.status_code == 401
    full = server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path": spare}
    )
    assert (
        full.status_code == 400 and "every LoRA slot is in use" in full.json()["error"]["message"]
    )
    assert (
        server.http.post("/v1/unload_lora_adapter", json={"lora_name": "code"}).status_code == 200
    )
    loaded = server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path": spare}
    )
    assert loaded.status_code == 200
    assert _complete(server, "spare") == _expected(setup, "spare")
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="code", prompt=PROMPT, max_tokens=2)
    for body, status in [
        ({"lora_name": "spare", "lora_path": spare}, 400),  # already served
        ({"lora_name": "bad", "lora_path": "/no/such/folder"}, 400),
        ({"lora_name": 5}, 400),
    ]:
        assert server.http.post("/v1/load_lora_adapter", json=body).status_code == status
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    # Back as the module's other tests expect it.
    assert (
        server.http.post("/v1/unload_lora_adapter", json={"lora_name": "spare"}).status_code == 200
    )
    code = setup.adapters["code"][0]
    back = server.http.post("/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": code})
    assert back.status_code == 200


def test_malformed_adapters_are_400_not_500(server, setup, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("[]")  # JSON, but not a config
    for path in [str(broken), "/" + "x" * 5000]:  # the second: a name too long for the OS
        response = server.http.post(
            "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": path}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "lora_path"
    assert [m.id for m in server.client.models.list().data] == [MODEL, "math", "code"]
    assert _complete(server, "math") == _expected(setup, "math")


def test_an_adapter_in_use_is_not_unloaded(server, setup):
    """Paused, the engine holds the call's request unfinished: a deterministic 'in use'."""
    server.engine.pause(keep_weights=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_complete, server, "math")
            deadline = time.monotonic() + 30
            while _requests_under(server.engine, "math") == 0:
                assert time.monotonic() < deadline, "the call never reached the engine"
                time.sleep(0.01)
            response = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
            assert response.status_code == 400
            assert "in use" in response.json()["error"]["message"]
            server.engine.resume()
            assert pending.result(timeout=60) == _expected(setup, "math")
    finally:
        server.engine.resume()  # a no-op when resumed
    assert "math" in {m.id for m in server.client.models.list().data}


def _requests_under(engine, name) -> int:
    return next(info.requests for info in engine.list_loras() if info.name == name)


def test_runtime_updates_are_off_by_default(setup):
    engine = Engine(copy.deepcopy(setup.base), setup.tokenizer, cbgen.EngineConfig(num_blocks=16))
    try:
        app = create_app(engine, setup.tokenizer, MODEL, api_key=API_KEY)
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        with uvicorn_in_thread(uv) as base:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                body = {"lora_name": "x", "lora_path": "/tmp"}
                response = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=30)
                assert response.status_code == 404
        app.state.cbgen.close()
    finally:
        engine.close()


def test_a_bad_adapter_fails_the_start(setup):
    engine = Engine(copy.deepcopy(setup.base), setup.tokenizer, cbgen.EngineConfig(num_blocks=16))
    try:
        with pytest.raises(ValueError, match="--lora-modules bad=/no/such: .*not a PEFT adapter"):
            create_app(engine, setup.tokenizer, MODEL, lora_modules={"bad": "/no/such"})
    finally:
        engine.close()


def test_lora_module_flags_parse():
    import argparse

    from cbgen.cli import build_parser
    from cbgen.frontends.args.lora import lora_module, lora_modules

    assert lora_module("a=/x/y") == ("a", "/x/y")
    assert lora_module('{"name": "b", "path": "/z"}') == ("b", "/z")
    with pytest.raises(argparse.ArgumentTypeError):
        lora_module("nopath")
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-loras", "3"]
        + ["--max-lora-rank", "16", "--enable-lora-runtime-updates"]
    )
    assert lora_modules(args) == {"a": "/x", "b": "/y"}
    assert (args.max_loras, args.max_lora_rank, args.enable_lora_runtime_updates) == (3, 16, True)
    assert not build_parser().parse_args(["serve"]).enable_lora_runtime_updates
    batch = build_parser().parse_args(
        ["batch", "--input", "i", "--output", "o"] + ["--lora-modules", "a=/x", "a=/y"]
    )
    with pytest.raises(ValueError, match="names 'a' twice"):
        lora_modules(batch)


def test_serve_refuses_to_start_with_a_bad_adapter(tiny_chat_model_dir, capsys):
    from cbgen.cli import main

    args = ["serve", "--model", str(tiny_chat_model_dir), "--lora-modules", "bad=/no/such"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--lora-modules bad=/no/such" in err and "not a PEFT adapter folder" in err


# -- batch jobs ---------------------------------------------------------------------------


def test_batch_rows_pick_adapters(tiny_chat_model_dir, tmp_path):
    from conftest import job_rows

    from cbgen.frontends.jobs.generator import Generator
    from cbgen.frontends.jobs.rows import row_request

    model, tokenizer = cbgen.load_model(str(tiny_chat_model_dir))
    adapter = make_adapter(model, 7, r=4, lora_alpha=8, target_modules="all-linear")
    adapter.save_pretrained(tmp_path / "a")
    rows = job_rows(4)
    rows[0]["lora"], rows[2]["lora"], rows[3]["lora"] = "a", "a", "missing"
    with Generator(
        str(tiny_chat_model_dir), max_new_tokens=5, lora_modules={"a": str(tmp_path / "a")}
    ) as generator:
        outputs = generator.generate_rows(rows)
    assert outputs[3]["finish_reason"] == "error"
    assert "unknown LoRA adapter 'missing'" in outputs[3]["error"]
    defaults = cbgen.SamplingParams(max_new_tokens=5)
    for index in range(3):
        request = row_request(rows[index], defaults, tokenizer)
        reference = adapter if rows[index].get("lora") else model
        prompt = request.prompt_token_ids
        want = reference_greedy(reference, prompt, request.params.max_new_tokens)
        assert outputs[index]["token_ids"] == want


def test_a_batch_job_with_a_bad_adapter_fails_up_front(tiny_chat_model_dir):
    from cbgen.frontends.jobs.generator import Generator

    with pytest.raises(ValueError, match="--lora-modules a=/no/such"):
        Generator(str(tiny_chat_model_dir), lora_modules={"a": "/no/such"})


def test_the_batch_cli_takes_lora_modules(tiny_chat_model_dir, tmp_path, capsys):
    from conftest import write_jsonl

    from cbgen.cli import main
    from cbgen.frontends.jobs.files import read_rows

    model, _ = cbgen.load_model(str(tiny_chat_model_dir))
    make_adapter(model, 9, r=4, lora_alpha=8, target_modules="all-linear").save_pretrained(
        tmp_path / "a"
    )
    rows = [
        {"id": "base", "prompt": "Hello"},
        {"id": "a", "prompt": "Hello", "lora": "a"},
        {"id": "missing", "prompt": "Hello", "lora": "b"},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["batch", "--model", str(tiny_chat_model_dir), "--input", str(tmp_path / "in.jsonl")]
    args += ["--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--no-progress"]
    assert main([*args, "--lora-modules", "a=/no/such"]) == 2  # before any row runs
    assert "--lora-modules a=/no/such" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists() or not read_rows(tmp_path / "out.jsonl")
    assert main([*args, "--lora-modules", f"a={tmp_path / 'a'}"]) == 0
    out = {row["id"]: row for row in read_rows(tmp_path / "out.jsonl")}
    assert out["base"]["error"] is None and out["a"]["error"] is None
    assert out["base"]["token_ids"] != out["a"]["token_ids"]
    assert out["a"]["lora"] == "a"  # the input columns are kept
    assert out["missing"]["finish_reason"] == "error"
    assert "unknown LoRA adapter 'b'" in out["missing"]["error"]
    assert "3 rows: 3 written (1 with an error)" in capsys.readouterr().out
