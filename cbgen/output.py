"""Apply a step to its requests: advance them when it is launched, settle them when its
tokens are known, and decide which requests are done."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .request import FinishReason, Request, RequestOutput
from .scheduler_output import SchedulerOutput

PLACEHOLDER_TOKEN = 0
"""Stands in for a token still being sampled (async scheduling): the next step's input
row gets the real id on the device, and ``resolve`` writes it into ``token_ids``."""


@dataclass
class PendingSamples:
    """The requests a launched step samples for, in logits-row order, and where each
    request's placeholder sits in its ``token_ids``."""

    requests: list[Request]
    positions: list[int]


class OutputProcessor:
    """The only place that changes a request's tokens after scheduling.

    A step is applied in two halves. ``advance`` runs when the step is launched:
    it appends a placeholder for every token the step samples, so the scheduler
    can plan the next step before this one is done (async scheduling; the
    scheduler counted the step's tokens as computed when it planned them). ``resolve`` runs when the sampled ids are
    known: it writes them over the placeholders and applies the stop rules. The
    synchronous loop calls the two back to back.

    ``model_eos_ids`` are the model's own end-of-sequence ids (finish reason
    ``eos``); a request's ``eos_token_ids`` add stop ids (``stop``).
    ``max_model_len`` is the context limit, model's or cache's, whichever is
    smaller.
    """

    def __init__(self, model_eos_ids: set[int], max_model_len: int) -> None:
        self.model_eos_ids = model_eos_ids
        self.max_model_len = max_model_len

    def advance(
        self, scheduled: SchedulerOutput, requests: Mapping[str, Request]
    ) -> PendingSamples:
        """``requests``: the unfinished requests by id (the step's are among them)."""
        sampled = [requests[s.request_id] for s in scheduled.scheduled if s.sample]
        positions = []
        for row, request in enumerate(sampled):
            positions.append(len(request.token_ids))
            request.token_ids.append(PLACEHOLDER_TOKEN)
            request.pending_index = positions[-1]
            request.pending_row = row
        return PendingSamples(sampled, positions)

    def resolve(
        self,
        pending: PendingSamples,
        sampled_tokens: list[int],
        errors: dict[int, str] | None = None,
    ) -> tuple[list[RequestOutput], list[tuple[Request, FinishReason]]]:
        """Returns the per-request outputs of the step and the requests to retire.

        ``errors`` maps a sampled row to why it has no token (a failed logits
        processor): that request finishes with ``"error"`` and no new token.
        Requests that finished (or were aborted) after the step was launched are
        skipped: with async scheduling a request can be in the next step already
        when this one tells it to stop, and that extra token is dropped.
        """
        outputs: list[RequestOutput] = []
        finished: list[tuple[Request, FinishReason]] = []
        rows = zip(pending.requests, pending.positions, sampled_tokens, strict=True)
        for row, (request, position, token) in enumerate(rows):
            if request.pending_index == position:
                request.pending_index = None
            if request.is_finished:
                continue
            error = errors.get(row) if errors else None
            if error is not None:
                reason: FinishReason | None = FinishReason.ERROR
                del request.token_ids[position:]
                end = position
            else:
                request.token_ids[position] = token
                reason = self._finish_reason(request, token, position)
                end = position + 1
                if reason is not None:
                    del request.token_ids[end:]  # tokens planned past the end
            if reason is not None:
                request.pending_index = None
                finished.append((request, reason))
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=request.token_ids[request.num_prompt_tokens : end],
                    finished=reason is not None,
                    finish_reason=reason,
                    new_token_ids=[] if error is not None else [token],
                    error=error,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        return outputs, finished

    def _finish_reason(self, request: Request, token: int, position: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos:
            if token in self.model_eos_ids:
                return FinishReason.EOS
            if token in params.eos_token_ids:
                return FinishReason.STOP
        if position + 1 - request.num_prompt_tokens >= params.max_new_tokens:
            return FinishReason.LENGTH
        if position + 1 >= self.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        return None
