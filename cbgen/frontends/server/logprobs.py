"""Logprobs in OpenAI's shapes, from the engine's ``dict[token_id, logprob]`` entries
(``cbgen.sampling.logprobs``: the top N first, in descending order, then the chosen token when
it is not among them).

* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry
  per token; ``top_logprobs`` maps token text to logprob and holds the top N and the
  chosen token (so up to N + 1 entries, as OpenAI documents); with ``echo`` the prompt
  tokens come first, the very first with ``None`` (what lm-eval's loglikelihood reads).
  ``text_offset`` adds up the tokens' text lengths, as vLLM does.
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` with
  exactly the N most likely tokens in ``top_logprobs``.
* ``prompt_logprobs`` (vLLM's extension): per prompt token ``None`` (the first) or
  ``{token_id: {"logprob", "rank", "decoded_token"}}``; ``rank`` is known for the top N
  only (``None`` for a token outside them).

A token's text is its own decode with special tokens kept (vLLM's ``decoded_token``);
its ``bytes`` are its raw bytes where the tokenizer is byte-level BPE (so a character
split across tokens can be put back together, as OpenAI means them), else the UTF-8 of
its text. Logprobs below -9999 (and -inf) are written as -9999.0, as vLLM does, since
JSON has no infinity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ...sampling.logprobs import TokenLogprobs

FLOOR = -9999.0


@dataclass
class Report:
    """What a call shows besides its text."""

    logprobs: int | None = None  # completions' ``logprobs`` / chat's ``top_logprobs``
    echo: bool = False  # completions: the prompt first
    drop_generated: bool = False  # ``max_tokens: 0`` with echo: one token run, not shown
    prompt_logprobs: int | None = None  # vLLM's extension
    echo_texts: list[str] = field(default_factory=list)  # per prompt, with ``echo``

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine must compute for this report."""
        counts = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            counts.append(self.logprobs)
        present = [c for c in counts if c is not None]
        return max(present) if present else None


def clamp(value: float) -> float:
    return value if value >= FLOOR else FLOOR


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


class TokenStrings:
    """Per-token text and bytes of one tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_of: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and "ByteLevel" in type(backend.decoder).__name__ + repr(
            backend.decoder
        ):
            self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _bytes(self, token_id: int) -> list[int]:
        byte_of = self._byte_of
        if byte_of is not None and token_id not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in byte_of for c in piece):
                return [byte_of[c] for c in piece]
        return list(self.text(token_id).encode("utf-8", errors="replace"))


def top(entry: TokenLogprobs, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely tokens of an entry (its first items)."""
    return list(entry.items())[:count]


class LogprobsWriter:
    """Writes one call's logprobs (``count`` alternatives per token)."""

    def __init__(self, strings: TokenStrings, count: int) -> None:
        self.strings = strings
        self.count = count

    def completion(
        self, token_ids: list[int], entries: list[TokenLogprobs | None], offset: int
    ) -> tuple[dict[str, Any], int]:
        """The completions shape for ``token_ids``, offsets starting at ``offset``; and
        the offset after them (a stream's next chunk goes on from there)."""
        text = self.strings.text
        tokens, logprobs, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries, strict=True):
            piece = text(token)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(clamp(entry[token]))
            shown = top(entry, self.count)
            if token not in dict(shown):
                shown.append((token, entry[token]))
            tops.append({text(t): clamp(v) for t, v in shown})
        body = {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return body, offset

    def chat(self, token_ids: list[int], entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """The chat shape's ``content`` list for ``token_ids``."""
        return [
            {
                **self._chat_token(token, entry[token]),
                "top_logprobs": [self._chat_token(t, v) for t, v in top(entry, self.count)],
            }
            for token, entry in zip(token_ids, entries, strict=True)
        ]

    def _chat_token(self, token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.strings.text(token),
            "logprob": clamp(logprob),
            "bytes": self.strings.bytes(token),
        }


def prompt_logprobs(
    strings: TokenStrings,
    prompt: list[int],
    entries: list[TokenLogprobs | None] | None,
    count: int,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: the top ``count`` and the prompt's own token."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(prompt, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = top(entry, count)
        shown = {t: (v, rank) for rank, (t, v) in enumerate(ranked, 1)}
        shown.setdefault(token, (entry[token], None))  # the prompt's token, outside the top
        out.append(
            {
                str(t): {"logprob": clamp(v), "rank": rank, "decoded_token": strings.text(t)}
                for t, (v, rank) in shown.items()
            }
        )
    return out
