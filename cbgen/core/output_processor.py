"""Apply a step to its requests: advance them when it is launched, settle them when its
tokens are known, and decide which requests are done."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..requests.request import FinishReason, Request, RequestOutput
from ..requests.scheduler_output import SchedulerOutput
from ..sampling.logprobs import TokenLogprobs, copy_entries
from ..spec.speculative import SpeculationCounts

PLACEHOLDER_TOKEN = 0
"""Stands in for a token still being sampled (async scheduling): the next step's input
row gets the real id on the device, and ``resolve`` writes it into ``token_ids``."""


@dataclass
class PendingSamples:
    """The requests a launched step samples for, in logits-row order, where each
    request's placeholder sits in its ``token_ids``, and the proposed tokens each
    verifies (one logits row per draft, then one for the token after them)."""

    requests: list[Request]
    positions: list[int]
    drafts: list[list[int]] | None = None  # None: no request verifies proposals
    prompt_scored: dict[str, Request] = field(default_factory=dict)  # scoring prompt tokens

    def rows(self) -> list[tuple[int, list[int]]]:
        """Per request: its first logits row and its drafts."""
        if self.drafts is None:
            return [(row, []) for row in range(len(self.requests))]
        out, row = [], 0
        for drafts in self.drafts:
            out.append((row, drafts))
            row += 1 + len(drafts)
        return out


class OutputProcessor:
    """The only place that changes a request's tokens after scheduling.

    A step is applied in two halves. ``advance`` runs when the step is launched:
    it appends a placeholder for every token the step samples, so the scheduler
    can plan the next step before this one is done (async scheduling; the
    scheduler counted the step's tokens as computed when it planned them). ``resolve`` runs when the sampled ids are
    known: it writes them over the placeholders and applies the stop rules. The
    synchronous loop calls the two back to back.

    ``model_eos_ids`` are the model's own end-of-sequence ids (finish reason
    ``eos``); a request's ``eos_token_ids`` and ``stop_token_ids`` add stop ids (``stop``).
    ``max_model_len`` is the context limit, model's or cache's, whichever is
    smaller.
    """

    def __init__(self, model_eos_ids: set[int], max_model_len: int) -> None:
        self.model_eos_ids = model_eos_ids
        self.max_model_len = max_model_len
        self.speculation = SpeculationCounts()  # verified proposals, for EngineCore.stats

    def advance(
        self, scheduled: SchedulerOutput, requests: Mapping[str, Request]
    ) -> PendingSamples:
        """``requests``: the unfinished requests by id (the step's are among them)."""
        chunks = scheduled.sampled
        sampled = [requests[s.request_id] for s in chunks]
        drafts = None
        if any(s.num_drafts for s in chunks):
            drafts = [s.token_ids[len(s.token_ids) - s.num_drafts :] for s in chunks]
        positions = []
        row = 0
        for request, chunk in zip(sampled, chunks, strict=True):
            positions.append(len(request.token_ids))
            request.token_ids.append(PLACEHOLDER_TOKEN)
            request.pending_index = positions[-1]
            request.pending_row = row
            row += chunk.num_sampled
        scored = {
            s.request_id: requests[s.request_id] for s in scheduled.scheduled if s.prompt_targets
        }
        return PendingSamples(sampled, positions, drafts, scored)

    def resolve(
        self,
        pending: PendingSamples,
        sampled_tokens: list[int],
        errors: dict[int, str] | None = None,
        logprobs: list[TokenLogprobs | None] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> tuple[list[RequestOutput], list[tuple[Request, FinishReason]]]:
        """Returns the per-request outputs of the step and the requests to retire.

        ``errors`` maps a sampled row to why it has no token (a failed logits
        processor): that request finishes with ``"error"`` and no new token.
        ``logprobs`` holds each sampled row's logprobs, ``prompt_logprobs`` the prompt
        positions a request's chunk scored (first position, entries).
        Requests that finished (or were aborted) after the step was launched are
        skipped: with async scheduling a request can be in the next step already
        when this one tells it to stop, and that extra token is dropped.
        """
        outputs: list[RequestOutput] = []
        finished: list[tuple[Request, FinishReason]] = []
        if prompt_logprobs:
            _record_prompt_logprobs(pending.prompt_scored, prompt_logprobs)
        rows = zip(pending.requests, pending.positions, pending.rows(), strict=True)
        for request, position, (row, drafts) in rows:
            if request.pending_index == position:
                request.pending_index = None
            if request.is_finished:
                continue
            error = None
            if errors:
                error = next(
                    (errors[r] for r in range(row, row + 1 + len(drafts)) if r in errors), None
                )
            new: list[int] = []
            reason: FinishReason | None = None
            if error is not None:
                reason = FinishReason.ERROR
                del request.token_ids[position:]
                end = position
            else:
                new = _accepted(sampled_tokens[row : row + 1 + len(drafts)], drafts)
                self.speculation.add(len(drafts), len(new) - 1)
                request.acceptance.record(len(drafts), len(new) - 1)
                request.token_ids[position : position + 1] = new
                for index, token in enumerate(new):
                    reason = self._finish_reason(request, token, position + index)
                    if request.grammar is not None and not request.grammar.accept(token):
                        error = f"token {token} is not allowed by the request's grammar"
                        reason = FinishReason.ERROR
                    elif request.text is not None and request.text.push(token):
                        reason = FinishReason.STOP  # a stop string ends here
                    if reason is not None:
                        del new[index + 1 :]
                        break
                end = position + len(new)
                if reason is not None:
                    del request.token_ids[end:]  # tokens planned past the end
                if request.logprobs is not None and logprobs is not None:
                    new_logprobs = logprobs[row : row + len(new)]
                    request.logprobs.extend(entry or {} for entry in new_logprobs)
            if reason is not None:
                request.pending_index = None
                finished.append((request, reason))
            text = new_text = None
            if request.text is not None:
                if reason is not None:
                    request.text.finish()
                    text = request.text.text
                new_text = request.text.take_new()
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=request.token_ids[request.num_prompt_tokens : end],
                    finished=reason is not None,
                    finish_reason=reason,
                    new_token_ids=new,
                    error=error,
                    num_cached_tokens=request.num_cached_tokens,
                    logprobs=copy_entries(request.logprobs),
                    new_logprobs=(
                        None
                        if request.logprobs is None
                        else request.logprobs[len(request.logprobs) - len(new) :]
                    ),
                    prompt_logprobs=copy_entries(request.prompt_logprobs),
                    text=text,
                    new_text=new_text,
                )
            )
        return outputs, finished

    def _finish_reason(self, request: Request, token: int, position: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos:
            if token in self.model_eos_ids:
                return FinishReason.EOS
            if token in params.stop_ids:
                return FinishReason.STOP
        if position + 1 - request.num_prompt_tokens >= params.max_new_tokens:
            return FinishReason.LENGTH
        if position + 1 >= self.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        return None


def _record_prompt_logprobs(
    requests: dict[str, Request], scored: dict[str, tuple[int, list[TokenLogprobs]]]
) -> None:
    """Append the scored prompt positions to their requests' ``prompt_logprobs``; chunks
    score positions in order, and a position already recorded is never appended again."""
    for request_id, (first, entries) in scored.items():
        request = requests.get(request_id)
        if request is None or request.prompt_logprobs is None:
            continue
        have = len(request.prompt_logprobs)
        if first <= have:
            request.prompt_logprobs.extend(entries[have - first :])


def _accepted(tokens: list[int], drafts: list[int]) -> list[int]:
    """The tokens a step adds when it verified ``drafts``: every draft up to the first
    that differs from the token sampled at its position, then the sampled token there.

    Each sampled token is drawn from the target model given all tokens before it, so
    keeping drafts only while they equal the samples yields exactly the tokens plain
    decoding would sample (greedy: the same tokens; sampled: the same distribution)."""
    accepted = 0
    while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
        accepted += 1
    return tokens[: accepted + 1]
