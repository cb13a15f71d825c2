"""Speculative decoding: proposers that guess a request's next tokens for the target to verify.

The mechanism lives elsewhere and trusts no proposal: a running request's
``draft_token_ids`` are scheduled as 1 + k tokens (``cbgen.scheduler``), scored in one
forward pass, and kept only while they equal the token the target samples at their
position (``cbgen.output``); the K/V of rejected positions is rolled back before it can be
read or cached. A proposer only decides what to write there, once per step, before the
step is scheduled. A wrong guess costs compute, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .request import Request

METHODS = ("ngram", "draft", "layer_skip")
NOT_BUILT = ("draft", "layer_skip")


@dataclass
class SpeculativeConfig:
    """How ``EngineCore`` proposes tokens to verify (``EngineConfig(speculative=...)``).

    ``method="ngram"`` is prompt lookup: the tokens that followed the most recent earlier
    occurrence of the request's last few tokens, in its own prompt and output (no extra
    model; pays off where the output quotes its input: rewriting, editing, answering from
    a pasted document). ``num_tokens`` is k, the most tokens proposed per request and step.
    ``"draft"`` (a small model sharing the tokenizer, ``draft_model``) and ``"layer_skip"``
    (the target's first ``num_layers`` layers) are reserved names, not built yet.
    """

    method: str = "ngram"
    num_tokens: int = 4
    draft_model: Any = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(
                f"speculative method {self.method!r} is not built yet; use method='ngram'"
            )
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be 'ngram', got {self.method!r}")
        if (
            isinstance(self.num_tokens, bool)
            or not isinstance(self.num_tokens, int)
            or self.num_tokens < 1
        ):
            raise ValueError(f"num_tokens must be an int >= 1, got {self.num_tokens!r}")


class Proposer:
    """Writes the ``draft_token_ids`` of every running request before a step.

    ``propose`` sees every running request; it must leave ``draft_token_ids`` empty for
    those that are not ``eligible`` (stale proposals would only waste a verification).
    """

    num_tokens: int

    def propose(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError


def eligible(request: Request) -> bool:
    """Whether proposals for ``request`` can be verified in its next step: it asks for
    them, its sampling does not read its history (processors, penalties and grammars
    see one row at a time), its prompt is computed and no token of it is being sampled."""
    params = request.params
    return (
        params.speculative
        and not params.needs_history
        and not request.is_finished
        and request.pending_index is None
        and request.num_computed_tokens >= request.num_tokens - 1
        and request.num_output_tokens < params.max_new_tokens
    )


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the request's last ``n``
    tokens (``n`` from ``max_ngram`` down to ``min_ngram``) in its prompt and output, and
    propose the (up to) ``num_tokens`` tokens that followed it. No match, no proposal.

    One numpy pass per request and step: candidates are the earlier positions holding
    the last token, narrowed by one token of context per ``n``, so the cost is linear
    in the request's length with a small constant."""

    def __init__(self, num_tokens: int, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens = num_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if eligible(request):
                request.draft_token_ids = self.lookup(request.token_ids)
            else:
                request.draft_token_ids = []

    def lookup(self, token_ids: list[int]) -> list[int]:
        """The proposal for a sequence ending in ``token_ids[-1]`` (empty: no match)."""
        length = len(token_ids)
        if length <= self.min_ngram:
            return []
        tokens = np.asarray(token_ids)
        # Positions p < length - 1 where an n-gram ending at p matches the suffix.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
        by_n = [ends]
        for m in range(1, min(self.max_ngram, length - 1)):
            ends = ends[ends >= m]
            ends = ends[tokens[ends - m] == tokens[length - 1 - m]]
            if len(ends) == 0:
                break
            by_n.append(ends)
        for n in range(min(len(by_n), self.max_ngram), self.min_ngram - 1, -1):
            found = by_n[n - 1]
            if len(found):
                start = int(found[-1]) + 1
                return token_ids[start : start + self.num_tokens]
        return []


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer ``config`` names (only ``"ngram"`` exists so far); None for None."""
    return None if config is None else NgramProposer(config.num_tokens)


@dataclass
class SpeculationCounts:
    """Running totals of verified proposals, kept by the output processor as it accepts
    them and copied into ``EngineCore.stats`` (``spec_*`` keys).

    ``proposed``: drafts verified (scheduled), ``accepted``: drafts kept, ``verifications``:
    request-steps that verified at least one draft. The mean accepted length is tokens
    gained per verification, the sampled token included (vLLM's definition).
    """

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.proposed += proposed
            self.accepted += accepted
            self.verifications += 1

    def stats(self) -> dict[str, float]:
        mean = 1.0 + self.accepted / self.verifications if self.verifications else 0.0
        return {
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_verifications": self.verifications,
            "spec_mean_accepted_length": mean,
        }
