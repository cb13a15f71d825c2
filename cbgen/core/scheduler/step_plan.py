"""The step being planned, and the order requests are taken in."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cache.kv_cache_manager import InFlightBlocks
from ...requests.request import Request


@dataclass
class StepPlan:
    """Bookkeeping of the step being planned."""

    budget: int
    scheduled: set[int] = field(default_factory=set)  # id() of requests with a chunk
    in_flight: InFlightBlocks = field(default_factory=InFlightBlocks)
    chunks: list[tuple[Request, int, int]] = field(default_factory=list)  # request, start, count


def request_key(request: Request) -> tuple[int, int]:
    """Queue and victim order: ``(priority, arrival)``, the lowest first."""
    return request.sort_key
