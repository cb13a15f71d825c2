"""A step's logits to its samples: what the sampler reads about each row, the grammar
rows' token bitmask, and the logprobs of the prompt tokens the step scores.

The bitmask is filled on the core thread, before the step is launched, from grammar
states the previous step settled; the rest runs with the forward pass (on the worker
thread under async scheduling) and reads only the step's own values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..requests.request import Request
from ..requests.scheduler_output import ScheduledRequest
from ..sampling.grammar import GrammarMatcher, allocate_bitmask, fill_bitmasks
from ..sampling.logits import LogitsRows
from ..sampling.logprobs import TokenLogprobs, target_logprobs
from ..sampling.sampler import Sampler, SamplerOutput
from .batch import StepBatch

Bitmask = tuple[torch.Tensor, torch.Tensor]
"""The allowed next tokens of the grammar rows (``[rows, words]`` int32) and the logits
rows they belong to."""


def grammar_bitmask(
    sampled: list[ScheduledRequest], requests: Mapping[str, Request], vocab_size: int
) -> Bitmask | None:
    """The bitmask of the sampled rows whose request has a grammar (None: no such row)."""
    rows: list[int] = []
    matchers: list[GrammarMatcher] = []
    for row, chunk in enumerate(sampled):
        grammar = requests[chunk.request_id].grammar
        if grammar is not None:
            rows.append(row)
            matchers.append(grammar)
    if not rows:
        return None
    bitmask = allocate_bitmask(len(rows), vocab_size)
    fill_bitmasks(matchers, bitmask)
    return bitmask, torch.tensor(rows, dtype=torch.long)


def sample_step(
    sampler: Sampler, batch: StepBatch, logits: torch.Tensor, bitmask: Bitmask | None
) -> SamplerOutput:
    """Sample the batch's sampled rows (the first ``len(batch.sampled)`` rows of
    ``logits``) and score its prompt rows (the rest)."""
    sampled = batch.sampled
    params = [s.params for s in sampled]
    rows = LogitsRows(
        params,
        [s.num_prompt_tokens for s in sampled],
        [p - s.num_prompt_tokens for p, s in zip(batch.sample_positions, sampled, strict=True)],
        [s.history for s in sampled],
    )
    generators = [s.generator for s in sampled]
    count = len(sampled)
    out = sampler(logits[:count], params, generators, rows.histories, rows, bitmask)
    if batch.prompt_scores:
        out.prompt_logprobs = score_prompts(batch.prompt_scores, logits[count:])
    return out


def score_prompts(
    chunks: list[ScheduledRequest], logits: torch.Tensor
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Per chunk: the first prompt position it scores and the logprobs there, from the
    logits of the rows before those positions."""
    targets = [token for chunk in chunks for token in chunk.prompt_targets]
    counts = [chunk.params.prompt_logprobs or 0 for chunk in chunks for _ in chunk.prompt_targets]
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    entries = target_logprobs(logits, index, counts)
    scored, start = {}, 0
    for chunk in chunks:
        end = start + len(chunk.prompt_targets)
        scored[chunk.request_id] = (chunk.prompt_start, entries[start:end])
        start = end
    return scored
