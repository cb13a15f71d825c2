"""A request's generated text inside the core: detokenized as its tokens are accepted and
cut at its first stop string, so that ``generate_batch`` and ``EngineCore`` stop on
strings the way the online engine does (the same ``IncrementalDetokenizer`` and
``StopStringMatcher``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .detokenizer import IncrementalDetokenizer, StopStringMatcher


class RequestText:
    """Text of one request's accepted tokens; ``push`` tells when a stop string completes.

    ``text`` is the text so far that no stop string can still claim; ``new_text`` what
    it gained since the last ``take_new``. On a match the text ends right before the stop
    string (after it with ``include_stop``).
    """

    __slots__ = ("_detok", "_stops", "text", "_taken", "done")

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
        stops: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(None, prompt_token_ids, decode=decode)
        self._stops = StopStringMatcher(stops, include_stop) if stops else None
        self.text = ""
        self._taken = 0
        self.done = False

    def push(self, token_id: int) -> bool:
        """Add one accepted token; True when it completes a stop string (the request ends)."""
        return self._add(self._detok.push([token_id]), final=False)

    def finish(self) -> None:
        """The request ended: release the text held back (half a character, a possible
        start of a stop string)."""
        if not self.done:
            self._add(self._detok.flush(), final=True)
            self.done = True

    def take_new(self) -> str:
        """The text added since the last call."""
        new = self.text[self._taken :]
        self._taken = len(self.text)
        return new

    def _add(self, piece: str, final: bool) -> bool:
        if self.done:
            return False
        if self._stops is None:
            self.text += piece
            return False
        safe, matched = self._stops.feed(piece, final=final)
        self.text += safe
        self.done = matched
        return matched
