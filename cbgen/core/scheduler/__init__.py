"""Decide, each step, which requests run and how many tokens each gets (``base``), in the
order a policy gives (``policies``). Blocks are the ``KVCacheManager``'s."""

from ...requests.scheduler_output import BlockMove, ScheduledRequest, SchedulerOutput
from .base import ADMIT, DECODE, PREFILL, Scheduler
from .policies import POLICIES, FifoScheduler, PrefillFirstScheduler, make_scheduler

__all__ = [
    "ADMIT",
    "DECODE",
    "POLICIES",
    "PREFILL",
    "BlockMove",
    "FifoScheduler",
    "PrefillFirstScheduler",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "make_scheduler",
]
