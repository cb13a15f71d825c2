"""Turn raw runs (wall time, per-request token timestamps) into the reported figures.

Pure Python on purpose: the peers' runners (``bench/peers/``) write the same raw record
from their own virtual environments, and the harness summarizes every system here.

A raw run is a dict::

    {"wall_s": 12.3,                      # from the first request in to the last token out
     "prompt_tokens": [31, 58, ...],      # per request
     "token_times": [[0.41, 0.52, ...],   # per request: seconds since the start of the run
                     ...] or None,        #   at which each output token was returned
     "output_tokens": [128, 128, ...]}    # per request

Every request arrives at time 0 (an offline batch), so a request's time to first token
includes its wait for a slot. Inter-token latency is the gap between two consecutive
tokens of one request, pooled over all requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

# The figures summarize() returns, in report order.
METRICS = (
    "output_tok_s",
    "prompt_tok_s",
    "wall_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_ms",
    "itl_p99_ms",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, like ``numpy.percentile``."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def summarize(run: dict[str, Any]) -> dict[str, float | None]:
    """The figures of one raw run."""
    wall = float(run["wall_s"])
    prompt_tokens = sum(run["prompt_tokens"])
    output_tokens = sum(run["output_tokens"])
    figures: dict[str, float | None] = {
        "output_tok_s": output_tokens / wall if wall > 0 else None,
        "prompt_tok_s": prompt_tokens / wall if wall > 0 else None,
        "wall_s": wall,
        "ttft_p50_s": None,
        "ttft_p99_s": None,
        "itl_p50_ms": None,
        "itl_p99_ms": None,
    }
    token_times = run.get("token_times")
    if token_times:
        firsts = [times[0] for times in token_times if times]
        gaps = [
            (later - earlier) * 1e3
            for times in token_times
            for earlier, later in zip(times, times[1:], strict=False)
        ]
        figures["ttft_p50_s"] = percentile(firsts, 50)
        figures["ttft_p99_s"] = percentile(firsts, 99)
        figures["itl_p50_ms"] = percentile(gaps, 50)
        figures["itl_p99_ms"] = percentile(gaps, 99)
    return figures


def median_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def median_figures(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The median over repeats of each figure (each figure on its own)."""
    per_run = [summarize(run) for run in runs]
    return {name: median_of(figures[name] for figures in per_run) for name in METRICS}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
