"""What the online engine hands back: outputs with text, its state snapshot, its errors."""

from __future__ import annotations

from dataclasses import dataclass

from ...requests.request import RequestOutput


class EngineClosedError(RuntimeError):
    """The engine is closed (or its loop died): it takes no new requests and has no result."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting to start (``EngineConfig.max_waiting_requests`` or
    ``max_queued_tokens``); try again later. ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class OnlineRequestOutput(RequestOutput):
    """A ``RequestOutput`` with text.

    As a stream delta, ``new_token_ids`` / ``new_text`` are what this delta adds
    (everything the stream had not read yet, when its consumer fell behind).
    ``token_ids`` is every token so far; ``text``, the whole text, is set only on
    the last delta of a request (``finished=True``, also what ``get_result``
    returns), so that streaming stays linear in the output length. ``text`` and
    ``new_text`` are ``None`` when the engine has no tokenizer. With a stop string,
    ``text`` ends right before it while ``token_ids`` keep every generated token.

    With ``SamplingParams.logprobs``, ``new_logprobs`` holds one entry per
    ``new_token_ids`` on every delta, and ``logprobs`` (one per ``token_ids``) comes with
    the last delta only, like ``text``; ``prompt_logprobs`` is on every delta once the
    prompt is scored (``SamplingParams.prompt_logprobs``).
    """

    text: str | None = None
    new_text: str | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as its loop thread last published it (after every step), so
    that other threads (a metrics scrape) never read the scheduler while it changes."""

    running: int = 0
    waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0  # truly free plus evictable cached blocks
    num_evictable_blocks: int = 0
    preemptions: int = 0
    cached_tokens: int = 0
    queued_requests: int = 0
    queued_tokens: int = 0
    unread_aborts: int = 0
    rejected: int = 0
    # Speculative decoding (``EngineCore.stats``' ``spec_*``): guesses verified and kept,
    # and verifications (request-steps that verified at least one guess).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
