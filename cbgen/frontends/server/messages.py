"""A chat choice's text as OpenAI's assistant message: reasoning, content and tool calls.

The text is read in order: a reasoning parser (``--reasoning-parser``) takes the
thinking section off the front; what follows is the answer, which a call's tool plan
reads (``cbgen.frontends.server.tools``): as content, as calls in the model's own
format (``auto``, through ``--tool-call-parser``), as the JSON list of calls that
``required`` forces, or as the arguments of the function a named choice forces. The
same objects serve a whole answer and a stream, where each chunk carries what is
certain so far (``delta.reasoning_content``, ``delta.content``, ``delta.tool_calls``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .reasoning import ReasoningParser
from .tool_parsers import ParsedToolCall, ToolParser, calls_from_json
from .tools import ToolPlan

__all__ = ["ChoiceMessage", "MessagePlan"]


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class MessagePlan:
    """How one call's choices become messages (``None`` on a call: plain content)."""

    tools: ToolPlan | None = None
    tool_parser: type[ToolParser] | None = None  # the server's, for tool_choice "auto"
    reasoning: type[ReasoningParser] | None = None  # the server's
    prompt_opened: bool = False  # the prompt left a reasoning section open

    def choice(self) -> ChoiceMessage:
        return ChoiceMessage(self)


class ChoiceMessage:
    """One choice's message, built whole (``whole``) or chunk by chunk (``feed``,
    ``finish``)."""

    def __init__(self, plan: MessagePlan) -> None:
        self.plan = plan
        self.reasoning = None
        if plan.reasoning is not None:
            self.reasoning = plan.reasoning(plan.prompt_opened)
        tools = plan.tools
        self.mode = "content" if tools is None or tools.choice == "none" else tools.choice
        self.parser = None
        if self.mode == "auto" and plan.tool_parser is not None:
            self.parser = plan.tool_parser()
        elif self.mode == "auto":
            self.mode = "content"
        self.held = ""  # the answer of a "required" choice, parsed at the end
        self.calls = 0  # tool calls sent so far
        self.named_id: str | None = None  # the forced function's call id, once sent
        self.arguments: list[str] = []  # the forced function's arguments, whole answer

    @property
    def has_calls(self) -> bool:
        return self.calls > 0

    # -- streaming ------------------------------------------------------------------------

    def feed(self, text: str) -> dict[str, Any]:
        """A chunk's ``delta`` fields for the next piece of text (empty: nothing yet)."""
        reasoning, answer = self._split(text, final=False)
        return self._delta(reasoning, *self._answer(answer, final=False))

    def finish(self) -> dict[str, Any]:
        """The ``delta`` fields of what was held back, at the end of the choice."""
        reasoning, answer = self._split("", final=True)
        return self._delta(reasoning, *self._answer(answer, final=True))

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        reasoning, answer = self.reasoning.feed(text)
        if final:
            more_reasoning, more_answer = self.reasoning.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        return reasoning, answer

    def _answer(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The answer's content and its tool-call deltas."""
        if self.mode == "content":
            return text, []
        if self.mode == "function":
            if not text and (self.named_id is not None or not final):
                return "", []
            self.arguments.append(text)
            return "", [self._named_delta(text)]
        if self.mode == "required":
            self.held += text
            if not final:
                return "", []
            return self._required()
        assert self.parser is not None
        content, calls = self.parser.feed(text)
        if final:
            tail, more = self.parser.finish()
            content, calls = content + tail, calls + more
        return content, self._call_deltas(calls)

    def _required(self) -> tuple[str, list[dict[str, Any]]]:
        try:
            value = json.loads(self.held)
        except (ValueError, RecursionError):  # cut short: the text as it stands
            return self.held, []
        calls = calls_from_json(value, ("arguments",)) if isinstance(value, list) else None
        if not calls:
            return self.held, []
        return "", self._call_deltas(calls)

    def _named_delta(self, arguments: str) -> dict[str, Any]:
        if self.named_id is None:
            self.named_id = tool_call_id()
            self.calls = 1
            tools = self.plan.tools
            assert tools is not None
            return {
                "index": 0,
                "id": self.named_id,
                "type": "function",
                "function": {"name": tools.function, "arguments": arguments},
            }
        return {"index": 0, "function": {"arguments": arguments}}

    def _call_deltas(self, calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
        tools = self.plan.tools
        if tools is not None and not tools.parallel:
            calls = calls[: max(0, 1 - self.calls)]  # parallel_tool_calls: false
        out = []
        for call in calls:
            out.append(
                {
                    "index": self.calls,
                    "id": tool_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self.calls += 1
        return out

    def _delta(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    # -- a whole answer -------------------------------------------------------------------

    def whole(self, text: str) -> dict[str, Any]:
        """The ``message`` of a finished choice."""
        first = self.feed(text)
        last = self.finish()
        reasoning = first.get("reasoning_content", "") + last.get("reasoning_content", "")
        content = first.get("content", "") + last.get("content", "")
        calls = first.get("tool_calls", []) + last.get("tool_calls", [])
        if self.mode == "function" and calls:  # its pieces, joined into one call
            head = calls[0]
            head["function"]["arguments"] = "".join(self.arguments)
            calls = [head]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content if content.strip() else None
            message["tool_calls"] = calls
            for call in calls:
                call.pop("index", None)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        return message

    def finish_reason(self, reason: str) -> str:
        """OpenAI's ``tool_calls`` for a choice that ended normally with calls."""
        return "tool_calls" if reason == "stop" and self.has_calls else reason
