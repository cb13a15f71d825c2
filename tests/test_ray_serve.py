"""examples/ray_serve.py: cbgen's OpenAI app as two Ray Serve replicas behind one route,
checked with the ``openai`` client against the engine's own greedy output."""

from __future__ import annotations

import importlib.util
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from conftest import chat_prompts  # noqa: E402

import cbgen  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "ray_serve.py"
QUESTIONS = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
MAX_TOKENS = 6


def _example():
    spec = importlib.util.spec_from_file_location("ray_serve_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_serve_example"] = module
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_chat_model_dir):
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        url = _example().deploy(
            str(tiny_chat_model_dir),
            replicas=2,
            threads=1,
            port=_free_port(),
            tool_call_parser="hermes",
        )
        yield url, serve.status()
        serve.shutdown()
    finally:
        ray.shutdown()


def test_two_replicas_serve_the_engines_greedy_answers(served, tiny_chat_model_dir):
    url, status = served
    deployment = status.applications["cbgen"].deployments["CbgenReplica"]
    assert sum(deployment.replica_states.values()) == 2, deployment.replica_states

    model, tokenizer = cbgen.load_model(str(tiny_chat_model_dir))
    reference = cbgen.generate_batch(
        model,
        chat_prompts(tokenizer, QUESTIONS),
        cbgen.SamplingParams(max_new_tokens=MAX_TOKENS),
        tokenizer=tokenizer,
    )
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model=str(tiny_chat_model_dir),
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:  # at once, so both replicas get some
        answers = list(pool.map(ask, QUESTIONS))
    assert answers == [o.text for o in reference]

    stream = client.chat.completions.create(
        model=str(tiny_chat_model_dir),
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == reference[0].text
    assert client.models.list().data[0].id == str(tiny_chat_model_dir)


def test_a_bad_request_is_the_apps_own_error(served, tiny_chat_model_dir):
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=str(tiny_chat_model_dir),
            messages=[{"role": "user", "content": "hi"}],
            temperature=-1.0,
        )


def test_the_replicas_get_the_servers_options(served, tiny_chat_model_dir):
    """The tool parser reached the app: tools with tool_choice auto get past the parser
    check to the template check (SmolLM2's template does not render tools)."""
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(
            model=str(tiny_chat_model_dir),
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],
        )
