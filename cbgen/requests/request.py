"""A request's state as it moves through the engine, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling.logprobs import TokenLogprobs
from ..sampling.params import SamplingParams
from .acceptance import DraftAcceptance
from .text import RequestText

if TYPE_CHECKING:
    from ..sampling.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V copied to the host swap space
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request (or one completion) ended; its value is what outputs and the server
    report (``str(reason)``)."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # one of the request's own extra stop ids
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT_LIMIT = "context_limit"  # the model's (or the cache's) context is full
    ABORTED = "aborted"  # cancelled by the caller
    TIMEOUT = "timeout"  # the request's own deadline passed (online engine, ``timeout``)
    ERROR = "error"  # rejected at admission, or failed in a step (``RequestOutput.error`` says why)

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    """One generation request.

    ``token_ids`` holds the prompt followed by every generated token, so that a
    preempted request can be recomputed from it alone. ``num_computed_tokens``
    counts the leading tokens whose K/V already sit in the request's blocks.

    Its blocks are the ``KVCacheManager``'s. ``block_hashes`` are the chain hashes
    of the full blocks of ``token_ids`` hashed so far (they never change: tokens
    are only appended). ``num_cached_tokens`` is how many prompt tokens the first
    admission took from the cache instead of computing them.

    With async scheduling the last entry of ``token_ids`` may be a placeholder for
    a token still being sampled (``pending_index``); see ``cbgen.core.output_processor``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Async scheduling: where the placeholder of a token being sampled sits in
    # ``token_ids`` (None: every token is known), and its row in that step's samples.
    pending_index: int | None = None
    pending_row: int = 0
    # Proposed continuation (speculative decoding): written by a proposer before each
    # step, verified in the request's next step (``cbgen.core.scheduler``), never trusted.
    draft_token_ids: list[int] = field(default_factory=list)
    acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)  # adaptive k
    # Per generated token / prompt position, when the params ask (``cbgen.sampling.logprobs``).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    text: RequestText | None = None  # with a tokenizer: the text and stop strings
    grammar: GrammarMatcher | None = None  # SamplingParams.structured_output's state
    # The LoRA adapter it runs under (None: the base model), its slot in the executor, and
    # what its prefix-cache hashes start from (K/V computed under another adapter, or
    # under this one's older weights, never matches).
    lora: str | None = None
    lora_slot: int = -1
    cache_salt: bytes = b""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.params.priority, self.arrival_order)


@dataclass
class Completion:
    """One sample of a prompt, as listed in ``RequestOutput.completions``."""

    token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    text: str | None = None


@dataclass
class RequestOutput:
    """What a finished (or streaming) request reports to the caller.

    ``num_cached_tokens`` is how many prompt tokens were read from the prefix
    cache rather than computed. ``completions`` is filled by ``generate_batch``:
    one ``Completion`` per sample (``SamplingParams.n`` of them, the first being
    the same as ``token_ids`` / ``finish_reason``); ``EngineCore.step`` leaves it empty.

    With ``SamplingParams(logprobs=N)``, ``logprobs`` has one ``dict[token_id, logprob]``
    per entry of ``token_ids`` (and ``new_logprobs`` per entry of ``new_token_ids``);
    with ``prompt_logprobs=N``, ``prompt_logprobs`` has one per prompt token, ``None``
    for the first (see ``cbgen.sampling.logprobs``). With a tokenizer (``EngineCore(tokenizer=)``,
    ``generate_batch(tokenizer=)``), ``new_text`` is the text this output adds and
    ``text`` the whole text once the request finished, cut at a stop string
    (``SamplingParams.stop``; ``token_ids`` then end with the token that completed it).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0
    completions: list[Completion] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    text: str | None = None
    new_text: str | None = None
