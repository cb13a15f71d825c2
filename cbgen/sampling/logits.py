"""Batch logits processors: penalties, biases and bans applied to the whole step's logits.

Each processor sees the step's float32 logits ``[rows, vocab]`` and the rows' state
(``LogitsRows``), picks the rows whose requests use it, and changes their logits in one
tensor pass (a gather, a scatter or a masked fill over all of them): the per-row work
is building small index lists, never a Python call per row and token. A request that
uses none of them costs nothing; a step where no row uses one skips it entirely.

The per-request Python processors of ``SamplingParams.logits_processors`` remain, as
the slow path for what cannot be written this way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass
class LogitsRows:
    """What processors may read about each logits row of a step.

    ``histories[i]`` is the prompt and output tokens before row ``i``'s token (``None``
    where the row's request reads no history: see ``SamplingParams.needs_history``);
    ``num_output_tokens[i]`` how many tokens the request generated before it.
    """

    params: list[SamplingParams]
    num_prompt_tokens: list[int]
    num_output_tokens: list[int]
    histories: Sequence[list[int] | None] | None = None

    def history(self, row: int) -> list[int]:
        history = self.histories[row] if self.histories is not None else None
        if history is None:
            raise ValueError(f"logits row {row} needs its request's tokens so far")
        return history


class BatchLogitsProcessor(ABC):
    """One logits transformation for every row of a step whose request asks for it."""

    @abstractmethod
    def uses(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` is changed by this processor."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        """Change ``logits[rows]`` in place (``rows``: the rows whose request uses it)."""


class LogitBias(BatchLogitsProcessor):
    """``logit_bias``: a value added to chosen tokens' logits (OpenAI's ``logit_bias``)."""

    def uses(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        index_rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row in rows:
            bias = state.params[row].logit_bias or {}
            index_rows += [row] * len(bias)
            tokens += bias.keys()
            values += bias.values()
        _put(logits, index_rows, tokens, values, accumulate=True)


class BadWords(BatchLogitsProcessor):
    """``bad_words``: ban a sequence's last token wherever the tokens before it were just
    generated (a one-token sequence is banned everywhere); transformers' ``bad_words_ids``."""

    def uses(self, params: SamplingParams) -> bool:
        return bool(params.bad_words)

    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        banned_rows: list[int] = []
        banned: list[int] = []
        pair_rows, prefixes, tails = [], [], []
        for row in rows:
            for words in state.params[row].bad_words:
                if len(words) == 1:
                    banned_rows.append(row)
                    banned.append(words[0])
                    continue
                history = state.history(row)
                prefix = list(words[:-1])
                tail = history[len(history) - len(prefix) :] if len(history) >= len(prefix) else []
                pair_rows.append(row)
                prefixes.append(prefix)
                tails.append((tail, words[-1]))
        if prefixes:
            # One comparison for every (row, sequence) pair: right-aligned, padded with -1
            # in the prefixes and -2 in the tails so padding never matches.
            width = max(len(p) for p in prefixes)
            want = torch.tensor([[-1] * (width - len(p)) + p for p in prefixes])
            have = torch.tensor([[-2] * (width - len(t)) + t for t, _ in tails])
            matched = ((want == have) | (want == -1)).all(dim=1).tolist()
            for row, (_, last), hit in zip(pair_rows, tails, matched, strict=True):
                if hit:
                    banned_rows.append(row)
                    banned.append(last)
        _put(logits, banned_rows, banned, float("-inf"))


class MinTokens(BatchLogitsProcessor):
    """``min_tokens``: every stop id (the model's EOS and the request's own) is banned
    until the request generated that many tokens (vLLM's rule; transformers'
    ``min_new_tokens`` bans the EOS ids of the generation config the same way)."""

    def __init__(self, model_eos_ids: Iterable[int]) -> None:
        self.model_eos_ids = sorted(model_eos_ids)

    def uses(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0 and not params.ignore_eos

    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        index_rows: list[int] = []
        tokens: list[int] = []
        for row in rows:
            params = state.params[row]
            if state.num_output_tokens[row] < params.min_tokens:
                stops = set(self.model_eos_ids).union(params.stop_ids)
                index_rows += [row] * len(stops)
                tokens += stops
        _put(logits, index_rows, tokens, float("-inf"))


class RepetitionPenalty(BatchLogitsProcessor):
    """``repetition_penalty`` over every token of the prompt and output: a positive logit
    is divided by it, a negative one multiplied (transformers' definition, which vLLM
    follows)."""

    def uses(self, params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0

    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        ids, _ = _padded_ids([state.history(row) for row in rows], logits.device)
        index = torch.tensor(rows, device=logits.device)
        values = logits.index_select(0, index)
        seen = values.gather(1, ids)
        penalty = torch.tensor(
            [state.params[row].repetition_penalty for row in rows], device=logits.device
        ).unsqueeze(1)
        # A token seen twice is written twice with the same value.
        values.scatter_(1, ids, torch.where(seen < 0, seen * penalty, seen / penalty))
        logits.index_copy_(0, index, values)


class PresenceFrequencyPenalty(BatchLogitsProcessor):
    """``presence_penalty`` and ``frequency_penalty`` over the output tokens:
    ``logit - presence * (count > 0) - frequency * count`` (OpenAI's definition)."""

    def uses(self, params: SamplingParams) -> bool:
        return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    def apply(self, logits: torch.Tensor, rows: list[int], state: LogitsRows) -> None:
        device = logits.device
        outputs = [state.history(row)[state.num_prompt_tokens[row] :] for row in rows]
        ids, real = _padded_ids(outputs, device)
        index = torch.tensor(rows, device=device)
        values = logits.index_select(0, index)
        presence = torch.tensor([state.params[r].presence_penalty for r in rows], device=device)
        frequency = torch.tensor([state.params[r].frequency_penalty for r in rows], device=device)
        # Presence once per distinct token (padding repeats a real token, so every write
        # to a token carries the same value; a row without output writes its own
        # values back), then frequency once per occurrence (no add for the padding).
        any_output = real[:, :1]
        values.scatter_(1, ids, values.gather(1, ids) - presence.unsqueeze(1) * any_output)
        values.scatter_add_(1, ids, -frequency.unsqueeze(1) * real)
        logits.index_copy_(0, index, values)


def default_processors(model_eos_ids: Iterable[int]) -> list[BatchLogitsProcessor]:
    """The built-in processors, in the order they apply: bias and bans first, then the
    penalties (vLLM's order), all before temperature."""
    return [
        LogitBias(),
        BadWords(),
        MinTokens(model_eos_ids),
        RepetitionPenalty(),
        PresenceFrequencyPenalty(),
    ]


def apply_processors(
    processors: Sequence[BatchLogitsProcessor], logits: torch.Tensor, state: LogitsRows
) -> None:
    """Run each processor once over the rows that use it."""
    for processor in processors:
        rows = [row for row, params in enumerate(state.params) if processor.uses(params)]
        if rows:
            processor.apply(logits, rows, state)


def _padded_ids(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists as one ``[rows, width]`` id tensor, each padded with its own first token
    (0 for an empty list), and a float mask of the real entries: a scatter then writes
    a padded slot's token the same value as its real slot."""
    width = max(1, max((len(tokens) for tokens in token_lists), default=0))
    ids = torch.tensor(
        [tokens + [tokens[0] if tokens else 0] * (width - len(tokens)) for tokens in token_lists],
        device=device,
    )
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    real = (torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return ids, real


def _put(
    logits: torch.Tensor,
    rows: list[int],
    tokens: list[int],
    values: float | list[float],
    accumulate: bool = False,
) -> None:
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    if isinstance(values, list):
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=accumulate)
    else:
        logits.index_put_(index, torch.tensor(values, device=device))
