"""Speculative decoding: proposers that guess a request's next tokens for the target to verify.

The mechanism lives elsewhere and trusts no proposal: a running request's
``draft_token_ids`` are scheduled as 1 + k tokens (``cbgen.core.scheduler``), scored in one
forward pass, and kept only while they equal the token the target samples at their
position (``cbgen.core.output_processor``); the K/V of rejected positions is rolled back before it can be
read or cached. A proposer only decides what to write there, once per step, before the
step is scheduled. A wrong guess costs compute, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

if TYPE_CHECKING:
    from ..requests.request import Request

METHODS = ("ngram", "draft", "layer_skip")
# Running requests at which each method stops proposing (``disable_batch_size="auto"``),
# measured with bench/speculative.py on SmolLM2 (CPU, 2 threads): prompt lookup still
# gains 1.12x at 8 requests and loses 2% at 16; the 4-bit self-draft gains 1.39x at 2
# and loses 14% at 4 (every prompt prefilled through the draft first).
DISABLE_BATCH_SIZE = {"ngram": 16, "draft": 4, "layer_skip": 4}
# What verifying one more token costs, as a share of a step: a step of b decoding
# requests that verifies g guesses takes about (1 + VERIFY_COST * g) times a plain step
# (SmolLM2, CPU, 2 threads: 0.03-0.05 per guess at 4 to 16 requests with 2 or 4 guesses
# each, nothing measurable at one request).
VERIFY_COST = 0.05


@dataclass
class SpeculativeConfig:
    """How ``EngineCore`` proposes tokens to verify (``EngineConfig(speculative=...)``).

    ``method="ngram"`` is prompt lookup: the tokens that followed the most recent earlier
    occurrence of the request's last few tokens, in its own prompt and output (no extra
    model; pays off where the output quotes its input: rewriting, editing, answering from
    a pasted document). ``method="draft"`` decodes the guesses greedily with
    ``draft_model``, a smaller ``transformers`` model sharing the target's tokenizer, on
    the target's device, with a paged KV cache of its own (``cbgen.spec.draft``).
    ``method="layer_skip"`` does the same with the target's first ``num_layers`` layers
    (its weights shared; ``None``: a quarter of them), the draft that needs no second
    checkpoint. ``num_tokens`` is k, the most tokens proposed per request and step;
    with ``adaptive`` (the default) fewer are made while guesses are often wrong or
    cost more than they save (``DraftAcceptance``, ``guess_cost``), ``adaptive=False``
    always makes k.

    ``disable_batch_size``: no proposals while this many requests or more are running
    (``None``: any number; ``"auto"``: the method's ``DISABLE_BATCH_SIZE``). A larger
    batch makes a step bound by compute instead of by reading the weights, and
    verifying guesses then costs more than it saves; a draft model also has every
    prompt to prefill first. On the bundled SmolLM2 (CPU, 2 threads,
    ``bench/speculative.py``) prompt lookup stops paying at 16 requests, a 4-bit
    self-draft at 4.
    """

    method: str = "ngram"
    num_tokens: int = 4
    draft_model: Any = None
    num_layers: int | None = None
    disable_batch_size: int | str | None = "auto"
    adaptive: bool = True

    @property
    def batch_limit(self) -> int | None:
        """``disable_batch_size`` with ``"auto"`` resolved."""
        if self.disable_batch_size == "auto":
            return DISABLE_BATCH_SIZE[self.method]
        assert not isinstance(self.disable_batch_size, str)
        return self.disable_batch_size

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft" and not isinstance(self.draft_model, nn.Module):
            raise ValueError(
                "method='draft' needs draft_model, a transformers model sharing the "
                f"target's tokenizer; got {type(self.draft_model).__name__}"
            )
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is for method='draft', not {self.method!r}")
        if self.num_layers is not None and (
            isinstance(self.num_layers, bool)
            or not isinstance(self.num_layers, int)
            or self.num_layers < 1
        ):
            raise ValueError(f"num_layers must be an int >= 1 or None, got {self.num_layers!r}")
        if self.disable_batch_size not in (None, "auto") and (
            isinstance(self.disable_batch_size, bool)
            or not isinstance(self.disable_batch_size, int)
            or self.disable_batch_size < 1
        ):
            raise ValueError(
                "disable_batch_size must be an int >= 1, 'auto' or None, "
                f"got {self.disable_batch_size!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {self.adaptive!r}")
        if self.method != "layer_skip" and self.num_layers is not None:
            raise ValueError(f"num_layers is for method='layer_skip', not {self.method!r}")
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
    It makes at most ``num_tokens`` guesses per request, fewer as their kept fraction
    (``DraftAcceptance``) and their cost (``guess_cost``) say, unless not ``adaptive``.
    """

    num_tokens: int
    adaptive: bool = True

    def propose(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def finish(self, request: Request) -> None:
        """``request`` left the engine: drop what the proposer keeps for it."""

    def reset(self) -> None:
        """Every K/V is stale (the weights changed): forget what was computed for requests."""

    def pause(self) -> None:
        """The engine pauses: release the executor (a draft model's own forward back)."""

    def resume(self) -> None:
        """The engine resumes: build the executor again from the weights as they are."""

    def release_cache(self) -> None:
        """The engine sleeps: free the KV cache (``allocate_cache`` gives it back)."""

    def observe_step(self, seconds: float, guesses: int) -> None:
        """How long a target forward pass took, verifying ``guesses`` guesses (a draft
        model weighs its own forward passes against it)."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's cache and executor)."""


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


def guess_cost(batch_size: int, draft_seconds: float = 0.0) -> float:
    """The cost of each request making one more guess this step, against what a kept
    guess saves, both as shares of a step of ``batch_size`` requests.

    A kept guess is one more token without a step of its own: in a batch of b requests
    that is 1/b of a step's tokens, so guesses for all b of them, each kept with chance
    p, save p of a step. Verifying them costs ``b * VERIFY_COST`` of a step, and a draft
    model's forward pass for them ``draft_seconds`` (as a share of a step). Guessing
    pays while ``p`` is above the sum, which grows with the batch: past a few requests
    on CPU a step is bound by compute, not by reading the weights, and guesses stop
    paying (``SpeculativeConfig.disable_batch_size`` then skips proposing at all)."""
    return batch_size * VERIFY_COST + draft_seconds


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the request's last ``n``
    tokens (``n`` from ``max_ngram`` down to ``min_ngram``) in its prompt and output, and
    propose the (up to) ``num_tokens`` tokens that followed it. No match, no proposal.
    A guess costs only its verification (``guess_cost`` with no draft).

    One numpy pass per request and step: candidates are the earlier positions holding
    the last token, narrowed by one token of context per ``n``, so the cost is linear
    in the request's length with a small constant."""

    def __init__(
        self, num_tokens: int, min_ngram: int = 2, max_ngram: int = 4, adaptive: bool = True
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, requests: Iterable[Request]) -> None:
        found: list[tuple[Request, list[int]]] = []
        for request in requests:
            request.draft_token_ids = []
            if eligible(request):
                guesses = self.lookup(request.token_ids)
                if guesses:  # only a match is a chance to guess
                    found.append((request, guesses))
        cost = guess_cost(len(found)) if self.adaptive else 0.0
        for request, guesses in found:
            request.draft_token_ids = guesses[: request.acceptance.draft_length(len(guesses), cost)]

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
