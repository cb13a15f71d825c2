"""Apply sampled tokens to requests and decide which requests are done."""

from __future__ import annotations

from .request import FinishReason, Request, RequestOutput
from .scheduler import SchedulerOutput


class OutputProcessor:
    """The only place that changes a request after a step.

    ``model_eos_ids`` are the model's own end-of-sequence ids (finish reason
    ``eos``); a request's ``eos_token_ids`` add stop ids (``stop``).
    ``max_model_len`` is the context limit, model's or cache's, whichever is
    smaller.
    """

    def __init__(self, model_eos_ids: set[int], max_model_len: int) -> None:
        self.model_eos_ids = model_eos_ids
        self.max_model_len = max_model_len

    def process(
        self,
        scheduled: SchedulerOutput,
        sampled_tokens: list[int],
        errors: dict[int, str] | None = None,
    ) -> tuple[list[RequestOutput], list[tuple[Request, FinishReason]]]:
        """Returns the per-request outputs of this step and the requests to retire.

        ``errors`` maps a sampled row to why it has no token (a failed logits
        processor): that request finishes with ``"error"`` and no new token.
        """
        for chunk in scheduled.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        outputs: list[RequestOutput] = []
        finished: list[tuple[Request, FinishReason]] = []
        sampled = [
            c.request
            for c in scheduled.chunks
            if c.request.num_computed_tokens == c.request.num_tokens
        ]
        for row, (request, token) in enumerate(zip(sampled, sampled_tokens, strict=True)):
            if errors and row in errors:
                finished.append((request, FinishReason.ERROR))
                outputs.append(
                    RequestOutput(
                        request_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        token_ids=request.output_token_ids,
                        finished=True,
                        finish_reason=FinishReason.ERROR,
                        error=errors[row],
                        num_cached_tokens=request.num_cached_tokens,
                    )
                )
                continue
            request.token_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                finished.append((request, reason))
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=request.output_token_ids,
                    finished=reason is not None,
                    finish_reason=reason,
                    new_token_ids=[token],
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        return outputs, finished

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos:
            if token in self.model_eos_ids:
                return FinishReason.EOS
            if token in params.eos_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_new_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        return None
