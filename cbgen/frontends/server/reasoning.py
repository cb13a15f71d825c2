"""Reasoning in a chat answer: the parsers ``--reasoning-parser`` chooses between.

Reasoning models write a thinking section before their answer (``<think> ... </think>``);
clients expect it apart, as the message's ``reasoning_content``, with the answer in
``content``. The two served formats differ in how an answer starts:

* ``deepseek_r1``: the answer always starts inside the section (DeepSeek-R1's
  templates open ``<think>`` in the prompt; a leading ``<think>`` in the output is
  dropped too), so text with no ``</think>`` is all reasoning.
* ``qwen3``: the section is there only if the output starts with ``<think>`` or the
  prompt left one open (Qwen3 with ``enable_thinking: false`` closes it in the prompt),
  so text that does not open it is all content.

A grammar (forced tools, ``response_format``) applies after the section
(``cbgen.ReasoningSection``), so the model thinks freely and answers in the format.
"""

from __future__ import annotations

from typing import ClassVar

from ...sampling.structured import ReasoningSection
from .tool_parsers import partial_suffix, registered

__all__ = ["REASONING_PARSERS", "ReasoningParser", "reasoning_parser_class"]

_REASONING, _UNDECIDED, _CONTENT = "reasoning", "undecided", "content"


class ReasoningParser:
    """Splits one choice's text into reasoning and content, whole or as it streams."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    always_opens: ClassVar[bool] = False  # the answer starts inside the section

    def __init__(self, prompt_opened: bool) -> None:
        """``prompt_opened``: the prompt ends inside an open section (``opened_by``)."""
        self.state = _REASONING if prompt_opened else _UNDECIDED
        self.buffer = ""
        self.after_end = False  # newlines right after the end marker are not content

    @classmethod
    def opened_by(cls, prompt_text: str) -> bool:
        """Whether ``prompt_text`` (the prompt's end) leaves a section open."""
        return prompt_text.rfind(cls.start) > prompt_text.rfind(cls.end)

    @classmethod
    def section(cls, prompt_opened: bool) -> ReasoningSection:
        """Where a grammar on this answer starts: after the section's end."""
        opens = prompt_opened or cls.always_opens
        return ReasoningSection(end=cls.end, start=None if opens else cls.start)

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of text: the reasoning and the content certain now."""
        self.buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buffer:
            if self.state == _UNDECIDED:
                head = self.buffer.lstrip()
                if head.startswith(self.start):
                    self.buffer = head[len(self.start) :]
                    self.state = _REASONING
                    continue
                if not head or self.start.startswith(head):
                    break  # may still open the section
                self.state = _REASONING if self.always_opens else _CONTENT
            elif self.state == _REASONING:
                at = self.buffer.find(self.end)
                if at < 0:
                    cut = len(self.buffer) - partial_suffix(self.buffer, self.end)
                    reasoning.append(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    break
                reasoning.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.end) :]
                self.state = _CONTENT
                self.after_end = True
            else:
                piece, self.buffer = self.buffer, ""
                if self.after_end:
                    piece = piece.lstrip("\n")
                    self.after_end = not piece
                content.append(piece)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the text."""
        rest, self.buffer = self.buffer, ""
        if self.state == _REASONING or (self.state == _UNDECIDED and self.always_opens):
            return rest, ""
        return "", rest

    def parse(self, text: str) -> tuple[str, str]:
        """A whole answer's reasoning and content."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_opens = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}
"""``--reasoning-parser`` names and their parsers."""


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; ``ValueError`` listing the known ones."""
    cls: type[ReasoningParser] = registered(REASONING_PARSERS, name, "reasoning parser")
    return cls
