"""How far a precision mode (bfloat16, a bfloat16 K/V cache, int8 or 4-bit weights) is from
float32, measured through cbgen's own engine.

Two measures, both run by ``generate_batch`` on the same path a user's requests take
(fast decoder, paged cache in its dtype, quantized kernels), so what they report is
what users get, not what the model's module code would give:

* ``perplexity``: the text is cut into segments, each one request whose prompt is
  its first token; a logits processor reads the log-probability of the text's next
  token from the float32 logits of every step and then forces that token, so every
  position is scored with the true prefix in the cache (teacher forcing by decoding).
* ``greedy_agreement``: how many of the first tokens of greedy outputs equal the
  float32 run's, averaged over prompts; the first difference ends the count, since
  everything after it continues another text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.config import EngineConfig
from ..frontends.generate import generate_batch
from ..sampling.params import SamplingParams


class _TeacherForcing:
    """Logits processor: record ``log p(next true token)``, then force that token."""

    def __init__(self, segment: Sequence[int]) -> None:
        self.segment = list(segment)
        self.logprobs: list[float] = []

    def __call__(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        target = self.segment[len(history)]
        self.logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[target]))
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced


@dataclass(frozen=True)
class Perplexity:
    value: float
    tokens: int  # positions scored

    @property
    def mean_nll(self) -> float:
        return math.log(self.value)


def perplexity(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    segment_len: int = 256,
    config: EngineConfig | None = None,
    max_segments: int | None = None,
) -> Perplexity:
    """Perplexity of ``model`` on ``token_ids`` through the engine (``config``), in segments
    of ``segment_len`` tokens scored in one batch (the last, shorter one included)."""
    if segment_len < 2:
        raise ValueError(f"segment_len must be at least 2, got {segment_len}")
    segments = [
        list(token_ids[i : i + segment_len])
        for i in range(0, len(token_ids), segment_len)
        if len(token_ids[i : i + segment_len]) >= 2
    ]
    if max_segments is not None:
        segments = segments[:max_segments]
    if not segments:
        raise ValueError("the text has fewer than 2 tokens")
    forcers = [_TeacherForcing(segment) for segment in segments]
    params = [
        SamplingParams(max_new_tokens=len(segment) - 1, ignore_eos=True, logits_processors=[forcer])
        for segment, forcer in zip(segments, forcers, strict=True)
    ]
    outputs = generate_batch(model, [s[:1] for s in segments], params, config)
    for output, segment in zip(outputs, segments, strict=True):
        if output.finish_reason == "error" or output.token_ids != segment[1:]:
            raise RuntimeError(f"teacher forcing did not follow the text: {output.finish_reason}")
    logprobs = [lp for forcer in forcers for lp in forcer.logprobs]
    return Perplexity(math.exp(-sum(logprobs) / len(logprobs)), len(logprobs))


def greedy_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    """Mean length of the common prefix of each pair of outputs."""
    if len(reference) != len(other) or not reference:
        raise ValueError("give the same number (> 0) of reference and other outputs")
    total = 0
    for a, b in zip(reference, other, strict=True):
        same = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
        total += same
    return total / len(reference)


def greedy_outputs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    config: EngineConfig | None = None,
) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in generate_batch(model, prompts, params, config)]
