"""What a call's choices show besides their generated text: the echoed prompt and the
logprobs (``cbgen.frontends.server.logprobs``), for a whole answer and chunk by chunk.

A streamed choice keeps its place: its first chunk carries the echoed prompt (and its
logprobs), later ones go on from there (``text_offset`` included). ``max_tokens: 0``
with ``echo`` runs one token, which no chunk shows and no usage counts.
"""

from __future__ import annotations

from typing import Any

from ..online import OnlineRequestOutput
from .logprobs import LogprobsWriter, Report, TokenStrings, prompt_logprobs


class ChoiceWriter:
    """One call's extras per choice; choice ``i`` answers prompt ``i // n``."""

    def __init__(
        self, report: Report, strings: TokenStrings, chat: bool, prompts: list[list[int]], n: int
    ) -> None:
        self.report = report
        self.strings = strings
        self.chat = chat
        self.prompts = prompts
        self.n = n
        self.writer = LogprobsWriter(strings, report.logprobs or 0)
        self.offsets: dict[int, int] = {}  # a streamed choice's next text offset

    @property
    def shows_tokens(self) -> bool:
        """Whether a chunk with tokens but no text is worth sending (it has logprobs)."""
        return self.report.logprobs is not None and not self.report.drop_generated

    def _prompt(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def _prompt_entries(self, index: int, out: OnlineRequestOutput) -> list[Any]:
        prompt = self._prompt(index)
        entries = list(out.prompt_logprobs or [])[: len(prompt)]
        return entries + [None] * (len(prompt) - len(entries))  # cut short before scoring

    def whole(self, index: int, final: OnlineRequestOutput) -> dict[str, Any]:
        """The extras of a finished choice: ``text``, ``logprobs`` and, asked for,
        ``prompt_logprobs`` (chat puts that one on the response, not the choice)."""
        report = self.report
        text = "" if report.drop_generated else (final.text or "")
        token_ids = [] if report.drop_generated else list(final.token_ids)
        entries: list[Any] = [] if report.drop_generated else list(final.logprobs or [])
        echoed = not self.chat and report.echo
        if echoed:
            text = report.echo_texts[index // self.n] + text
        out: dict[str, Any] = {"text": text, "logprobs": None}
        if report.logprobs is not None:
            if self.chat:
                out["logprobs"] = {"content": self.writer.chat(token_ids, entries)}
            else:
                if echoed:
                    token_ids = self._prompt(index) + token_ids
                    entries = self._prompt_entries(index, final) + entries
                out["logprobs"] = self.writer.completion(token_ids, entries, 0)[0]
        if report.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(index, final)
        return out

    def prompt_logprobs(self, index: int, out: OnlineRequestOutput) -> Any:
        prompt = self._prompt(index)
        count = self.report.prompt_logprobs or 0
        return prompt_logprobs(self.strings, prompt, self._prompt_entries(index, out), count)

    def chunk(self, index: int, delta: OnlineRequestOutput) -> tuple[str, Any]:
        """A streamed delta's text and logprobs (``None`` when not asked for)."""
        report = self.report
        first = index not in self.offsets
        text = "" if report.drop_generated else (delta.new_text or "")
        token_ids = [] if report.drop_generated else list(delta.new_token_ids)
        entries: list[Any] = [] if report.drop_generated else list(delta.new_logprobs or [])
        echoed = first and report.echo and not self.chat
        if echoed:
            text = report.echo_texts[index // self.n] + text
        if report.logprobs is None:
            self.offsets[index] = 0
            return text, None
        if self.chat:
            self.offsets[index] = 0
            return text, {"content": self.writer.chat(token_ids, entries)}
        if echoed:
            token_ids = self._prompt(index) + token_ids
            entries = self._prompt_entries(index, delta) + entries
        logprobs, self.offsets[index] = self.writer.completion(
            token_ids, entries, self.offsets.get(index, 0)
        )
        return text, logprobs
