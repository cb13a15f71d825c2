"""Incremental detokenization and stop strings for streamed generation.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas
without ever emitting half of a multi-byte character, and without decoding the
whole sequence at every step. It decodes two short windows of ids each time:

* ``ids[prefix:read]``: the tokens just before the unread ones (already emitted),
  kept as context so that tokenizers whose output depends on the neighbouring
  token (SentencePiece's leading-space marker, byte-level BPE pieces of one
  character) decode the same way they would in the full sequence;
* ``ids[prefix:]``: the same context plus the unread tokens.

The new text is what the second decode adds to the first. When it ends in
U+FFFD (an incomplete UTF-8 sequence, e.g. the first byte-token of a CJK
character or an emoji) nothing is emitted and the offsets stay put, so the next
token completes it. ``flush()`` emits what is left at the end of a request,
even an incomplete character, so the concatenated deltas equal a plain decode.

``StopStringMatcher`` finds stop strings in the text as it streams, including a
stop string split across tokens: it holds back the longest tail that could
still grow into a stop string, and on a match returns the text before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as context for the first generated tokens.
PROMPT_CONTEXT = 5
# Once this many consumed ids pile up at the front of the window list, drop them.
_TRIM_AFTER = 256


def make_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """A ``ids -> str`` function for ``tokenizer``, without cleanup of spaces.

    For a ``transformers`` fast tokenizer whose ``_decode`` is the stock one, the
    Rust backend is called directly (same text, about three times faster); any
    other tokenizer goes through its ``decode``. A bare ``tokenizers.Tokenizer``
    works too.
    """
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - transformers depends on it
        tokenizers = None  # type: ignore[assignment]
    if tokenizers is not None and isinstance(tokenizer, tokenizers.Tokenizer):
        backend = tokenizer
    else:
        backend = _stock_backend(tokenizer)
    if backend is not None:

        def decode_backend(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_backend

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


def _stock_backend(tokenizer: Any) -> Any:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    cls = type(tokenizer)
    if cls._decode is not TokenizersBackend._decode or cls.decode is not TokenizersBackend.decode:
        return None  # a subclass with its own decoding rules: go through them
    return getattr(tokenizer, "_tokenizer", None)


class IncrementalDetokenizer:
    """Text deltas of one request's generated tokens (see the module docstring).

    ``prompt_token_ids`` only provides context: the prompt's text is never emitted.
    ``text`` is everything emitted so far.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "text")

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self._decode = decode or make_decoder(tokenizer, skip_special_tokens)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # first id whose text has not been emitted
        self.text = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        ids = self._ids
        ids.extend(token_ids)
        if len(ids) == self._read:
            return ""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full_text = self._decode(ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (a special token) or half a character: wait
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(ids)
        if self._prefix >= _TRIM_AFTER:
            del ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD)."""
        ids = self._ids
        if len(ids) == self._read:
            return ""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full_text = self._decode(ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read = len(ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any of ``stops``.

    ``feed`` takes the next piece of text and returns ``(safe, matched)``:
    ``safe`` is the text that can be shown now, and ``matched`` tells that a stop
    string was found (``safe`` then ends right before it and the stream is over).
    Text that might be the start of a stop string is held back until the next
    piece decides; ``final=True`` releases it. With ``include_stop`` the text on a
    match ends right after the stop string instead (``include_stop_str_in_output``).
    After a match every ``feed`` returns ``("", True)``. The engine core
    (``cbgen.requests.text``) and the online engine (``cbgen.frontends.online.text``) both cut here.
    """

    __slots__ = ("stops", "matched", "include_stop", "_pending")

    def __init__(self, stops: Iterable[str], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        if not self.stops or not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.matched: str | None = None
        self.include_stop = include_stop
        self._pending = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        pending = self._pending + piece
        if not pending:
            return "", False
        cut = -1
        for stop in self.stops:
            at = pending.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.matched = at, stop
        if cut != -1:
            self._pending = ""
            end = cut + len(self.matched) if self.include_stop and self.matched else cut
            return pending[:end], True
        hold = 0 if final else self._partial_match(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return (pending[: len(pending) - hold] if hold else pending), False

    def _partial_match(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
