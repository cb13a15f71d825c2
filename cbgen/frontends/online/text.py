"""A request's text on the online engine's loop thread: incremental detokenization and
stop strings.

With a tokenizer, every request gets a ``TextProcessor``: its token ids become text
deltas (``cbgen.requests.detokenizer.IncrementalDetokenizer``) and, when the request lists stop
strings, the text is cut right before the first one (``StopStringMatcher``, the same
cut as the core's ``cbgen.requests.text``; right after it with ``include_stop``); the engine then
finishes the request with ``"stop"`` and aborts it in the core.

How special tokens are written is a per-request choice, as in vLLM: ``TextOptions``
(``skip_special_tokens``, ``spaces_between_special_tokens``). The decoders are cached
per tokenizer and option, since a server asks for the same few combinations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...requests.detokenizer import IncrementalDetokenizer, StopStringMatcher, make_decoder


@dataclass(frozen=True)
class TextOptions:
    """How a request's token ids become text (vLLM's two detokenization settings).

    ``skip_special_tokens`` drops special tokens from the text. With it off,
    ``spaces_between_special_tokens=False`` writes a special token that follows
    another one as its bare content, without the space a SentencePiece-style decoder
    puts in front (vLLM's fast-tokenizer rule; byte-level BPE adds no space anyway)."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def stop_matcher(
    request_id: str, stop: Sequence[str] | str | None, tokenizer: Any, include_stop: bool = False
) -> StopStringMatcher | None:
    """The matcher for a request's ``stop`` argument (``None`` when it lists none);
    ``ValueError`` naming the request when the strings are invalid or there is no
    tokenizer to match them on. ``include_stop``: the text keeps the stop string."""
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not stops:
        return None
    if tokenizer is None:
        raise ValueError(f"request {request_id!r}: stop strings need a tokenizer")
    try:
        return StopStringMatcher(stops, include_stop)
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None


class Decoders:
    """One tokenizer's decode functions per ``skip_special_tokens``, and its added
    (special) tokens' contents, computed once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoders: dict[bool, Callable[[list[int]], str]] = {}
        self._added: dict[int, str] | None = None

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        decode = self._decoders.get(skip_special_tokens)
        if decode is None:
            decode = self._decoders[skip_special_tokens] = make_decoder(
                self.tokenizer, skip_special_tokens
            )
        return decode

    def added_tokens(self) -> dict[int, str]:
        if self._added is None:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._added = {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}
        return self._added

    def processor(
        self,
        prompt_ids: list[int],
        options: TextOptions,
        stops: StopStringMatcher | None = None,
    ) -> TextProcessor:
        bare = not options.skip_special_tokens and not options.spaces_between_special_tokens
        return TextProcessor(
            prompt_ids,
            self.decoder(options.skip_special_tokens),
            stops,
            special_tokens=self.added_tokens() if bare else None,
        )


class TextProcessor:
    """One request's text deltas, cut at its first stop string (loop thread only).

    ``special_tokens`` (id -> content): write a special token that follows another
    as its bare content (``spaces_between_special_tokens=False``)."""

    __slots__ = ("detok", "stops", "special_tokens", "last_special")

    def __init__(
        self,
        prompt_ids: list[int],
        decode: Callable[[list[int]], str],
        stops: StopStringMatcher | None = None,
        *,
        special_tokens: dict[int, str] | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(None, prompt_ids, decode=decode)
        self.stops = stops
        self.special_tokens = special_tokens or None
        self.last_special = False

    def push(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """The text ``token_ids`` add (and what was held back, once ``finished``), and
        whether a stop string matched: then the text ends right before it (after it
        with ``include_stop``)."""
        if self.special_tokens is None:
            text = self.detok.push(token_ids)
        else:
            text = "".join(self._push_one(token) for token in token_ids)
        if finished:
            text += self.detok.flush()
        return self._cut(text, finished)

    def _push_one(self, token: int) -> str:
        # vLLM's rule: a special token right after another one is its bare content. The
        # text before a special token is never held back (the token completes it).
        piece = self.detok.push([token])
        content = self.special_tokens.get(token) if self.special_tokens else None
        if content is not None and self.last_special:
            piece = content
        self.last_special = content is not None
        return piece

    def flush(self) -> str:
        """The closing text of a request that ends without a new token."""
        return self._cut(self.detok.flush(), True)[0]

    def _cut(self, text: str, final: bool) -> tuple[str, bool]:
        if self.stops is None:
            return text, False
        return self.stops.feed(text, final=final)
