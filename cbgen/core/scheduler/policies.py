"""The scheduling policies: the order of a step's phases, chosen by name."""

from __future__ import annotations

from typing import Any

from .base import ADMIT, DECODE, PREFILL, Scheduler


class FifoScheduler(Scheduler):
    """Running decodes first, then running prefills, then admissions in queue order."""

    policy = "fifo"
    phases = (DECODE, PREFILL, ADMIT)


class PrefillFirstScheduler(Scheduler):
    """Prefills (running, then newly admitted) before decodes, to fill batches faster.

    New requests are admitted only while the blocks the decodes of this step need
    stay free, so admission never forces a decode out; decodes take the budget left.
    """

    policy = "prefill_first"
    phases = (PREFILL, ADMIT, DECODE)


POLICIES: dict[str, type[Scheduler]] = {
    FifoScheduler.policy: FifoScheduler,
    PrefillFirstScheduler.policy: PrefillFirstScheduler,
}


def make_scheduler(policy: str, *args: Any, **kwargs: Any) -> Scheduler:
    """The scheduler of ``policy`` (``"fifo"`` or ``"prefill_first"``), built with the
    arguments of ``Scheduler``."""
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown scheduler policy {policy!r}; use one of {sorted(POLICIES)}"
        ) from None
    return cls(*args, **kwargs)
