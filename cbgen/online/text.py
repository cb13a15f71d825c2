"""A request's text on the online engine's loop thread: incremental detokenization and
stop strings.

With a tokenizer, every request gets a ``TextProcessor``: its token ids become text
deltas (``cbgen.detokenizer.IncrementalDetokenizer``) and, when the request lists stop
strings, the text is cut right before the first one (``StopStringMatcher``); the engine
then finishes the request with ``"stop"`` and aborts it in the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..detokenizer import IncrementalDetokenizer, StopStringMatcher


def stop_matcher(
    request_id: str, stop: Sequence[str] | str | None, tokenizer: Any
) -> StopStringMatcher | None:
    """The matcher for a request's ``stop`` argument (``None`` when it lists none);
    ``ValueError`` naming the request when the strings are invalid or there is no
    tokenizer to match them on."""
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not stops:
        return None
    if tokenizer is None:
        raise ValueError(f"request {request_id!r}: stop strings need a tokenizer")
    try:
        return StopStringMatcher(stops)
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None


class TextProcessor:
    """One request's text deltas, cut at its first stop string (loop thread only)."""

    __slots__ = ("detok", "stops")

    def __init__(
        self,
        prompt_ids: list[int],
        decode: Callable[[list[int]], str],
        stops: StopStringMatcher | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(None, prompt_ids, decode=decode)
        self.stops = stops

    def push(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """The text ``token_ids`` add (and what was held back, once ``finished``), and
        whether a stop string matched: then the text ends right before it."""
        text = self.detok.push(token_ids)
        if finished:
            text += self.detok.flush()
        return self._cut(text, finished)

    def flush(self) -> str:
        """The closing text of a request that ends without a new token."""
        return self._cut(self.detok.flush(), True)[0]

    def _cut(self, text: str, final: bool) -> tuple[str, bool]:
        if self.stops is None:
            return text, False
        return self.stops.feed(text, final=final)
