"""Tool calls and reasoning through the server, with the official ``openai`` client.

The bundled SmolLM2-135M-Instruct runs in float32 under a chat template of the tests'
own (``data/hermes_tools.jinja``: SmolLM2's template does not render tools). A 135M
model does not call tools on its own, but it copies a pattern from the conversation:
given earlier turns in which the assistant called a tool, it calls one for the new
question, in the template's Hermes format. What the server answers is checked against
``model.generate()`` on the same prompt, read by the same parser, so the parsing is
tested on the model's real output and the tokens are exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from test_server import smollm2_tokenizer, uvicorn_in_thread, wait_idle  # noqa: E402

import cbgen  # noqa: E402
from cbgen.frontends.online import Engine  # noqa: E402
from cbgen.frontends.server import create_app  # noqa: E402
from cbgen.frontends.server.reasoning import Qwen3ReasoningParser  # noqa: E402
from cbgen.frontends.server.tool_parsers import HermesToolParser  # noqa: E402

MODEL = "smollm2-tools"
TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Local time in a city", "parameters": CITY},
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def called(city: str, name: str = "get_weather", call_id: str = "call_0") -> dict:
    arguments = json.dumps({"city": city})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


# Earlier turns in which the assistant called a tool: the model follows the pattern.
HISTORY = [
    {"role": "user", "content": "What is the weather in Rome?"},
    called("Rome", call_id="call_1"),
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C in Rome."},
    {"role": "user", "content": "What is the weather in Oslo?"},
    called("Oslo", call_id="call_2"),
]
THINKING = [
    {"role": "system", "content": "Think inside <think></think> first, then answer."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>2 plus 2 makes 4.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 3?"},
]


@pytest.fixture(scope="module")
def served(smollm2):
    model, _ = smollm2  # generate()'s; the engine hooks a copy of its own
    tokenizer = smollm2_tokenizer()  # a copy of its own: the template is the test's
    tokenizer.chat_template = TEMPLATE.read_text()
    plain = smollm2_tokenizer()  # SmolLM2's own template, which ignores tools
    engine_model, _ = cbgen.load_model("smollm2", tokenizer=False)
    engine = Engine(engine_model, tokenizer, cbgen.EngineConfig(num_blocks=256, block_size=16))
    apps = {
        "tools": create_app(engine, tokenizer, MODEL, tool_call_parser="hermes"),
        "reasoning": create_app(engine, tokenizer, MODEL, reasoning_parser="qwen3"),
        "plain": create_app(engine, plain, MODEL, tool_call_parser="hermes"),
    }
    servers = {
        name: uvicorn.Server(uvicorn.Config(app, log_level="warning")) for name, app in apps.items()
    }
    try:
        with (
            uvicorn_in_thread(servers["tools"]) as tools,
            uvicorn_in_thread(servers["reasoning"]) as reasoning,
            uvicorn_in_thread(servers["plain"]) as plain_base,
        ):

            def client(base):
                return openai.OpenAI(
                    base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120
                )

            yield SimpleNamespace(
                engine=engine,
                model=model,
                tokenizer=tokenizer,
                tools=client(tools),
                reasoning=client(reasoning),
                plain=client(plain_base),
                http=httpx.Client(base_url=tools, timeout=120),
            )
    finally:
        engine.close()


def greedy_text(served, messages, tools=None, max_tokens=60) -> str:
    """``model.generate()``'s greedy answer to the conversation, as the server renders it."""
    tokenizer = served.tokenizer
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = served.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def template_messages(messages):
    """The messages as the chat template gets them (arguments decoded)."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]
            ]  # fmt: skip
        message["content"] = message.get("content") or ""
        out.append(message)
    return out


def ask(client, messages, stream=False, max_tokens=60, **fields):
    """One chat call: (message as a dict, finish_reason), a stream gathered into the same
    shape (checking how its deltas are laid out on the way)."""
    call = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields)
    if not stream:
        answer = client.chat.completions.create(**call)
        choice = answer.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(**call, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for part in delta.tool_calls or []:
            if part.index not in calls:  # a call's first delta names it
                assert part.id and part.type == "function" and part.function.name, part
                calls[part.index] = {
                    "id": part.id,
                    "type": "function",
                    "function": {"name": part.function.name, "arguments": ""},
                }
            else:
                assert part.id is None and part.function.name is None, part
            calls[part.index]["function"]["arguments"] += part.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    message = {"role": "assistant"}
    if content:
        message["content"] = content
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        assert sorted(calls) == list(range(len(calls)))
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason


def call_names_and_arguments(message):
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message.get("tool_calls", [])
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_with_two_tools(served, stream):
    """auto: the model calls a tool; the tool's result goes back through the template;
    the model answers. Each turn is what generate() says, read by the same parser."""
    messages = [*HISTORY, {"role": "user", "content": "What is the weather in Paris?"}]
    message, reason = ask(served.tools, messages, stream, tools=TOOLS)
    expected = greedy_text(served, template_messages(messages), TOOLS)
    content, calls = HermesToolParser().parse(expected)
    assert calls, f"the model did not call a tool: {expected!r}"
    assert call_names_and_arguments(message) == [
        (call.name, json.loads(call.arguments)) for call in calls
    ]
    assert call_names_and_arguments(message) == [("get_weather", {"city": "Paris"})]
    assert reason == "tool_calls" and not message.get("content")
    ids = [call["id"] for call in message["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)

    messages += [
        {**message, "content": None},
        {"role": "tool", "tool_call_id": ids[0], "content": "12C and rainy"},
    ]
    message, reason = ask(served.tools, messages, stream, tools=TOOLS)
    expected = greedy_text(served, template_messages(messages), TOOLS)
    content, calls = HermesToolParser().parse(expected)
    assert message.get("content", "") == content
    assert call_names_and_arguments(message) == [(c.name, json.loads(c.arguments)) for c in calls]
    final, reason = ask(served.tools, messages, stream, tools=TOOLS, tool_choice="none")
    assert reason == "stop" and final["content"] and "tool_calls" not in final
    wait_idle(served.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_follow_their_schemas(served, stream):
    question = [{"role": "user", "content": "What is the weather and the time in Tokyo?"}]
    message, reason = ask(served.tools, question, stream, tools=TOOLS, tool_choice="required")
    calls = call_names_and_arguments(message)
    assert reason == "tool_calls" and len(calls) >= 2, message
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert {name for name, _ in calls} == {"get_weather", "get_time"}
    one, reason = ask(
        served.tools, question, stream, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    assert reason == "tool_calls" and len(one["tool_calls"]) == 1
    wait_idle(served.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(served, stream):
    question = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    choice = {"type": "function", "function": {"name": "get_time"}}
    message, reason = ask(served.tools, question, stream, tools=TOOLS, tool_choice=choice)
    ((name, arguments),) = call_names_and_arguments(message)
    assert name == "get_time" and reason == "tool_calls"
    jsonschema.validate(arguments, CITY)
    assert not message.get("content")


def test_a_named_function_streams_its_arguments(served):
    """The arguments arrive piece by piece, after a first delta that names the call."""
    question = [{"role": "user", "content": "What is the time in Lima?"}]
    body = {"model": MODEL, "messages": question, "max_tokens": 40, "temperature": 0,
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "stream": True}  # fmt: skip
    with served.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line[6:7] == "{"]
    deltas = [e["choices"][0]["delta"].get("tool_calls") for e in events]
    pieces = [d[0]["function"]["arguments"] for d in deltas if d]
    assert len(pieces) > 2 and json.loads("".join(pieces))["city"]
    assert [d[0]["function"].get("name") for d in deltas if d][:2] == ["get_time", None]


def test_bad_tools_are_400s(served):
    question = [{"role": "user", "content": "hi"}]
    bad = [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools", "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "combined"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs",
         "tokenize"),
    ]  # fmt: skip
    for fields, param, word in bad:
        with pytest.raises(openai.BadRequestError) as e:
            served.tools.chat.completions.create(
                model=MODEL, messages=question, max_tokens=2, **fields
            )
        assert e.value.body["param"] == param and word in e.value.body["message"], e.value.body
    for messages, word in [
        (
            [{"role": "user", "content": "hi", "tool_calls": called("x")["tool_calls"]}],
            "tool_calls",
        ),
        ([{"role": "user", "content": "hi", "tool_call_id": "x"}], "tool_call_id"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}], "tool_calls"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            served.tools.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert word in e.value.body["message"], e.value.body
    wait_idle(served.engine)


def test_a_template_that_ignores_tools(served):
    """auto needs the model to see the tools: refused, naming why; forced calls run."""
    question = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    with pytest.raises(openai.BadRequestError) as e:
        served.plain.chat.completions.create(model=MODEL, messages=question, tools=TOOLS)
    assert e.value.body["param"] == "tools" and "chat template" in e.value.body["message"]
    message, reason = ask(served.plain, question, tools=TOOLS, tool_choice="required")
    assert reason == "tool_calls" and call_names_and_arguments(message)


def test_auto_needs_a_parser(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.reasoning.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
        )
    assert "--tool-call-parser" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_answer(served, stream):
    message, reason = ask(served.reasoning, THINKING, stream)
    expected = greedy_text(served, THINKING)
    assert expected.startswith("<think>") and "</think>" in expected, expected
    reasoning, content = Qwen3ReasoningParser(False).parse(expected)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert reasoning and content and "think>" not in reasoning + content
    assert reason == "stop"
    # no section opened: all content
    plain, _ = ask(served.reasoning, [{"role": "user", "content": "Say hi."}], stream)
    assert plain["content"] and not plain.get("reasoning_content")


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_starts_after_the_reasoning(served, stream):
    """The model thinks freely, then answers under the schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    free, _ = ask(served.reasoning, THINKING, stream)
    message, reason = ask(
        served.reasoning, THINKING, stream,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    assert message["reasoning_content"] == free["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), schema)
    assert reason == "stop"
    wait_idle(served.engine)
