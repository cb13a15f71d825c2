"""Tool calls in a model's own words: the parsers ``--tool-call-parser`` chooses between.

With ``tool_choice: "auto"`` the model decides whether to call a tool, and writes the
call in the format its chat template taught it. A parser finds those calls in the
generated text, whole or as it streams, and hands back the rest as the message's
content. The formats served:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes,
  Qwen 2.5 and 3, SmolLM2; a JSON list of calls inside one tag is read too).
* ``llama3_json``: Llama 3.1-3.3's JSON calls, ``{"name": ..., "parameters": {...}}``,
  as the whole answer (several separated by ``;``, an optional ``<|python_tag|>``).
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of calls, or by
  ``name[ARGS]{...}`` (the newer tokenizers' form).

More formats plug in with ``register_tool_parser``: a subclass of ``ToolParser`` that
implements ``feed`` and ``finish``. Streaming holds back only what might still turn
into a call (a partial start marker, a call not yet closed); text that cannot becomes
content at once. A call whose JSON does not parse is left in the content as written,
so nothing the model said is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedToolCall",
    "ToolParser",
    "register_tool_parser",
    "tool_parser_class",
]


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in the text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolParser:
    """Finds tool calls in one choice's text; a new instance per choice.

    ``feed`` takes the next piece of text and returns the content that is certain now
    and the calls completed by it; ``finish`` flushes what was held back at the end.
    ``skip_special_tokens`` is what the format needs from detokenizing: ``False`` where
    its markers are special tokens (Mistral's ``[TOOL_CALLS]``)."""

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """A whole answer's content and calls."""
        content, calls = self.feed(text)
        tail, more = self.finish()
        return content + tail, calls + more


def calls_from_json(value: Any, argument_keys: tuple[str, ...]) -> list[ParsedToolCall] | None:
    """The calls in a decoded JSON value (one call object or a list of them); ``None``
    when it is not shaped as calls (each needs a string ``name``; the arguments, under
    the first of ``argument_keys`` present, an object or JSON text; missing means ``{}``)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments: Any = {}
        for key in argument_keys:
            if key in item:
                arguments = item[key]
                break
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``:
    what a stream must hold back because the next piece may complete the marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>``, any number of them between content."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    argument_keys = ("arguments", "parameters")

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False
        self.after_call = False  # whitespace right after a call is not content

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buffer += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.start)
                if at < 0:
                    keep = partial_suffix(self.buffer, self.start)
                    cut = len(self.buffer) - keep
                    self._say(content, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    break
                self._say(content, self.buffer[:at])
                self.buffer = self.buffer[at + len(self.start) :]
                self.inside = True
            else:
                at = self.buffer.find(self.end)
                if at < 0:
                    break
                body = self.buffer[:at]
                self.buffer = self.buffer[at + len(self.end) :]
                self.inside = False
                found = calls_from_json(_loads(body), self.argument_keys)
                if found is None:
                    self._say(content, self.start + body + self.end)
                else:
                    calls.extend(found)
                    self.after_call = True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.inside:  # cut short inside a call: a call if its JSON is whole
            self.inside = False
            found = calls_from_json(_loads(rest), self.argument_keys)
            if found is not None:
                return "", found
            rest = self.start + rest
        out: list[str] = []
        self._say(out, rest)
        return "".join(out), []

    def _say(self, content: list[str], piece: str) -> None:
        if self.after_call:
            piece = piece.lstrip()
            self.after_call = not piece
        content.append(piece)


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls: an answer that starts with ``{`` (or ``<|python_tag|>``) is
    calls, several separated by ``;``; any other answer is content, streamed as it comes."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    argument_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None: undecided; "content" or "calls"

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or (self.tag.startswith(head) and head != self.tag):
                return "", []
            self.mode = "calls" if head.startswith(("{", self.tag)) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return rest, []
        body = rest.strip().removeprefix(self.tag).strip()
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        at = 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return rest, []
            found = calls_from_json(value, self.argument_keys)
            if found is None:
                return rest, []
            calls.extend(found)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return ("", calls) if calls else (rest, [])


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` and what follows it: a JSON list of calls, or ``name[ARGS]{...}``
    per call. Its marker is a special token, so the text keeps special tokens."""

    name = "mistral"
    skip_special_tokens = False
    start = "[TOOL_CALLS]"
    args = "[ARGS]"
    argument_keys = ("arguments", "parameters")

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buffer += text
        if self.inside:
            return "", []
        at = self.buffer.find(self.start)
        if at >= 0:
            out = self.buffer[:at]
            self.buffer = self.buffer[at:]
            self.inside = True
            return out, []
        cut = len(self.buffer) - partial_suffix(self.buffer, self.start)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return rest, []
        calls: list[ParsedToolCall] = []
        for part in rest.split(self.start)[1:]:
            part = part.strip().removesuffix("</s>").strip()
            if self.args in part:
                name, _, arguments = part.partition(self.args)
                found = calls_from_json(
                    {"name": name.strip(), "arguments": _loads(arguments)}, self.argument_keys
                )
            else:
                found = calls_from_json(_loads(part), self.argument_keys)
            if found is None:
                return rest, []
            calls.extend(found)
        return ("", calls) if calls else (rest, [])


TOOL_PARSERS: dict[str, type[ToolParser]] = {}
"""``--tool-call-parser`` names and their parsers."""


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    """Serve another tool-call format under ``cls.name`` (usable as a class decorator)."""
    if not cls.name:
        raise ValueError("a tool parser needs a name")
    TOOL_PARSERS[cls.name] = cls
    return cls


for _parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
    register_tool_parser(_parser)


def registered(table: dict[str, Any], name: str, what: str) -> Any:
    """``table[name]``; ``ValueError`` naming the ``what`` and listing the known ones."""
    found = table.get(name)
    if found is None:
        raise ValueError(f"unknown {what} {name!r} (known: {', '.join(sorted(table))})")
    return found


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as ``name``; ``ValueError`` listing the known ones."""
    cls: type[ToolParser] = registered(TOOL_PARSERS, name, "tool call parser")
    return cls
