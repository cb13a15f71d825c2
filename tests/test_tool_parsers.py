"""The tool-call and reasoning parsers on texts in each format: whole, and streamed in
every way a text can be cut into pieces (a stream must end up saying what the whole
answer says, without ever showing a marker as content)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.frontends.server.messages import MessagePlan
from cbgen.frontends.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    reasoning_parser_class,
)
from cbgen.frontends.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedToolCall,
    ToolParser,
    register_tool_parser,
    tool_parser_class,
)
from cbgen.frontends.server.tools import closed_objects, plan_tools

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris"}')
TIME = ParsedToolCall("get_time", '{"city": "Lima", "utc": true}')

CASES = [
    # (parser, text, content, calls)
    (HermesToolParser, "Hello there.", "Hello there.", []),
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     "</tool_call>", "", [WEATHER]),
    (HermesToolParser, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
     '{"city": "Lima", "utc": true}}</tool_call>', "Let me look.\n", [WEATHER, TIME]),
    # SmolLM2's form: a list inside one tag; arguments given as JSON text
    (HermesToolParser, '<tool_call>[{"name": "get_weather", "arguments": "{\\"city\\": '
     '\\"Paris\\"}"}, {"name": "get_time", "arguments": {"city": "Lima", "utc": true}}]'
     "</tool_call>", "", [WEATHER, TIME]),
    # not a call: kept as written
    (HermesToolParser, "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok",
     []),
    (HermesToolParser, "a < b <tool_ is not a tag", "a < b <tool_ is not a tag", []),
    # cut short inside a call whose JSON is whole, or not
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [WEATHER]),
    (HermesToolParser, '<tool_call>{"name": "get_wea', '<tool_call>{"name": "get_wea', []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [WEATHER]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
     '"Paris"}}; {"name": "get_time", "parameters": {"city": "Lima", "utc": true}}', "",
     [WEATHER, TIME]),
    (Llama3JsonToolParser, "It is sunny {maybe}.", "It is sunny {maybe}.", []),
    (Llama3JsonToolParser, '{"answer": 4}', '{"answer": 4}', []),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
     "</s>", "", [WEATHER]),
    (MistralToolParser, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]'
     'get_time[ARGS]{"city": "Lima", "utc": true}', "Sure. ", [WEATHER, TIME]),
    (MistralToolParser, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
]  # fmt: skip


def normalized(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_answers(parser, text, content, calls):
    got_content, got_calls = parser().parse(text)
    assert (got_content, normalized(got_calls)) == (content, normalized(calls))


def cuts(text):
    return st.lists(st.integers(0, len(text)), max_size=8).map(lambda c: sorted(set(c)))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_streams_say_what_whole_answers_say(data):
    parser, text, content, calls = data.draw(st.sampled_from(CASES))
    points = data.draw(cuts(text))
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    streamed = parser()
    got_content, got_calls = "", []
    for piece in pieces:
        more, found = streamed.feed(piece)
        got_content += more
        got_calls += found
    tail, found = streamed.finish()
    assert (got_content + tail, normalized(got_calls + found)) == (content, normalized(calls))


THINK_CASES = [
    # (parser, prompt opened, text, reasoning, content)
    (Qwen3ReasoningParser, False, "<think>3 plus 3 is 6.</think>\n\nThe answer is 6.",
     "3 plus 3 is 6.", "The answer is 6."),
    (Qwen3ReasoningParser, False, "The answer is 6.", "", "The answer is 6."),
    (Qwen3ReasoningParser, False, "<thin", "", "<thin"),
    (Qwen3ReasoningParser, True, "hmm, six.</think>Six.", "hmm, six.", "Six."),
    (Qwen3ReasoningParser, False, "<think>still thinking", "still thinking", ""),
    (DeepSeekR1ReasoningParser, False, "Let me add.</think>6", "Let me add.", "6"),
    (DeepSeekR1ReasoningParser, False, "<think>Let me add.</think>6", "Let me add.", "6"),
    (DeepSeekR1ReasoningParser, False, "no end marker", "no end marker", ""),
    (DeepSeekR1ReasoningParser, True, "a < b </thi", "a < b </thi", ""),
]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_reasoning_streams_say_what_whole_answers_say(data):
    parser, opened, text, reasoning, content = data.draw(st.sampled_from(THINK_CASES))
    assert parser(opened).parse(text) == (reasoning, content)
    points = data.draw(cuts(text))
    streamed = parser(opened)
    got = ["", ""]
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        more = streamed.feed(text[a:b])
        got = [got[0] + more[0], got[1] + more[1]]
    tail = streamed.finish()
    assert (got[0] + tail[0], got[1] + tail[1]) == (reasoning, content)


def test_which_prompts_open_a_section():
    assert Qwen3ReasoningParser.opened_by("<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.opened_by("<think>\n\n</think>\n\n")
    assert Qwen3ReasoningParser.section(False).start == "<think>"
    assert Qwen3ReasoningParser.section(True).start is None
    assert DeepSeekR1ReasoningParser.section(False).start is None


def test_a_choice_message_with_reasoning_and_calls():
    plan = plan_tools([{"type": "function", "function": {"name": "get_weather"}}], "auto", None,
                      "hermes")  # fmt: skip
    message_plan = MessagePlan(plan, HermesToolParser, Qwen3ReasoningParser, False)
    text = ('<think>Paris, so weather.</think><tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}</tool_call>')  # fmt: skip
    message = message_plan.choice().whole(text)
    assert message["reasoning_content"] == "Paris, so weather."
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    streamed = message_plan.choice()
    deltas = [streamed.feed(text[i : i + 5]) for i in range(0, len(text), 5)] + [streamed.finish()]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris, so weather."
    assert not any("content" in d for d in deltas)
    assert streamed.finish_reason("stop") == "tool_calls"


def test_one_call_without_parallel_calls():
    plan = plan_tools([{"type": "function", "function": {"name": "get_weather"}}], "auto", False,
                      "hermes")  # fmt: skip
    text = '<tool_call>[{"name": "get_weather"}, {"name": "get_weather"}]</tool_call>'
    message = MessagePlan(plan, HermesToolParser).choice().whole(text)
    assert len(message["tool_calls"]) == 1


def test_forced_objects_are_closed():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
              "$defs": {"b": {"type": "object", "properties": {"c": {"type": "string"}}}},
              "additionalProperties": True}  # fmt: skip
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is True  # said: kept
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["b"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]  # the caller's is untouched


def test_parsers_register_by_name():
    class Shouty(ToolParser):
        name = "test_shouty"

        def feed(self, text):
            return text.upper(), []

        def finish(self):
            return "", []

    try:
        register_tool_parser(Shouty)
        assert tool_parser_class("test_shouty") is Shouty
    finally:
        TOOL_PARSERS.pop("test_shouty", None)
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_class("nope")
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser_class("nope")


def test_newlines_after_the_end_marker_in_a_later_piece():
    parser = Qwen3ReasoningParser(False)
    pieces = ["<think>3 plus 3 is 6.</think>\n", "\n", "The answer", " is 6."]
    said = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    assert "".join(r for r, _ in said) == "3 plus 3 is 6."
    assert "".join(c for _, c in said) == "The answer is 6."
