"""A request's state as it moves through the engine, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # one of the request's own extra stop ids
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT_LIMIT = "context_limit"  # the model's (or the cache's) context is full
    ABORTED = "aborted"  # cancelled by the caller
    ERROR = "error"  # rejected at admission (only reported, never scheduled)

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    """One generation request.

    ``token_ids`` holds the prompt followed by every generated token, so that a
    preempted request can be recomputed from it alone. ``num_computed_tokens``
    counts the leading tokens whose K/V already sit in the request's blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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


@dataclass
class RequestOutput:
    """What a finished (or streaming) request reports to the caller."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
