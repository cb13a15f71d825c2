"""Logprobs of chosen tokens and of the most likely alternatives, for many rows at once.

A position's logprobs are a ``dict[token_id, logprob]``: the ``N`` most likely tokens in
descending order, then the chosen token if it is not among them (so it is always there,
and the dict holds ``N`` or ``N + 1`` entries). They come from a ``log_softmax`` of the
model's float32 logits before any processor, penalty or temperature (vLLM's default
``raw_logprobs``), computed in one pass for every row that asks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenLogprobs = dict[int, float]


def token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, counts: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` (``[rows, vocab]``, already normalized): the top
    ``counts[row]`` tokens and ``chosen[row]``."""
    if logprobs.shape[0] == 0:
        return []
    picked = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1).tolist()
    width = max(counts, default=0)
    top_values: list[list[float]] = [[] for _ in counts]
    top_ids: list[list[int]] = [[] for _ in counts]
    if width:
        values, ids = logprobs.topk(width, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for token, value, count, ids_row, values_row in zip(
        chosen.tolist(), picked, counts, top_ids, top_values, strict=True
    ):
        entry = dict(zip(ids_row[:count], values_row[:count], strict=True))
        entry.setdefault(token, value)
        out.append(entry)
    return out


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, counts: Sequence[int]
) -> list[TokenLogprobs]:
    """``token_logprobs`` from raw float32 logits (``[rows, vocab]``), for the tokens
    that follow (``targets``): what prompt logprobs are."""
    return token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, counts)


def copy_entries(entries: list | None) -> list | None:
    """A new list of the same entries (``None`` stays ``None``): an output's own copy of
    a request's logprobs, which keep growing after it is handed out."""
    return None if entries is None else list(entries)
