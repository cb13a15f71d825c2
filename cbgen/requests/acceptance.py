"""A request's record of how often its speculative guesses are kept (adaptive draft
length); it lives on the request, the proposers in ``cbgen.spec`` read it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DraftAcceptance:
    """How often a request's guesses are kept, and so how many to make next (adaptive k).

    Each verification of ``n`` guesses keeping ``m`` is ``m`` kept guesses, then one
    rejection if ``m < n``: the kept fraction ``rate = kept / (kept + rejected)``
    estimates the chance that a guess is kept given the ones before it were (older
    verifications fade by ``DECAY`` each). The j-th guess is kept with chance
    ``rate ** j``; ``draft_length`` makes guesses while that chance exceeds their cost
    (``guess_cost``). At length 0 a request still makes one guess after
    ``PROBE_EVERY`` chances, then after twice as many each time the probe changes
    nothing (up to ``MAX_PROBE_EVERY``), so a rate that recovers is seen and a draft
    that never fits costs little. The output processor records verifications
    (``record``); the proposer reads ``draft_length``.
    """

    DECAY = 0.8
    PROBE_EVERY = 8
    MAX_PROBE_EVERY = 128

    kept: float = 2.0  # the prior: two kept, one rejected (rate 2/3)
    rejected: float = 1.0
    idle: int = 0  # chances passed without a guess
    probe_every: int = PROBE_EVERY

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def record(self, verified: int, kept: int) -> None:
        if verified:
            self.kept = self.DECAY * self.kept + kept
            self.rejected = self.DECAY * self.rejected + (1 if kept < verified else 0)

    def draft_length(self, most: int, cost: float) -> int:
        """Guesses worth making now: the largest ``k <= most`` with ``rate ** k``
        above ``cost`` (0 when even one is not worth it, but for the probes)."""
        rate = self.rate
        if cost <= 0.0:
            k = most
        elif rate <= cost:  # a cost of a whole step or more never pays
            k = 0
        elif rate >= 1.0:
            k = most
        else:
            k = min(most, int(math.log(cost) / math.log(rate)))
        if k == 0:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle = 0
                self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)
                return 1
        else:
            self.idle = 0
            self.probe_every = self.PROBE_EVERY
        return k
