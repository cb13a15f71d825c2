"""Server metrics in the Prometheus text format (0.0.4), written without a client library.

Counters and histograms are updated on the server's event-loop thread only (where the
request handlers run), so they need no lock; the engine gauges (running / waiting
requests, KV blocks) are read from the core at scrape time.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help = help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help}")
        lines.append(f"# TYPE {self.name} histogram")
        cumulative = 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts, strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """What ``GET /metrics`` reports for one online engine."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # engine requests (choices) by finish reason
        self.http: Counter[tuple[str, int]] = Counter()  # API calls by endpoint and status
        self.disconnects = 0
        self.ttft = Histogram(
            "cbgen_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "cbgen_inter_token_latency_seconds",
            "Time between two consecutive generated tokens of one request.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "cbgen_request_latency_seconds",
            "Time from receiving a request to its last token.",
            LATENCY_BUCKETS,
        )

    def render(self) -> str:
        core = self.engine.core
        scheduler = core.scheduler
        allocator = core.allocator
        total = allocator.num_blocks
        free = allocator.num_free  # truly free plus evictable cached blocks
        used = total - free
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_num(value)}")

        model = f'{{model="{_escape(self.model_name)}"}}'
        metric(
            "cbgen_requests_running",
            "gauge",
            "Requests in the running batch.",
            [(model, len(scheduler.running))],
        )
        metric(
            "cbgen_requests_waiting",
            "gauge",
            "Requests queued for admission.",
            [(model, len(scheduler.waiting))],
        )
        metric("cbgen_kv_blocks_total", "gauge", "KV cache blocks.", [("", total)])
        metric("cbgen_kv_blocks_used", "gauge", "KV cache blocks held by requests.", [("", used)])
        metric(
            "cbgen_kv_blocks_cached_free",
            "gauge",
            "Unused KV blocks kept for prefix reuse (evicted on demand).",
            [("", allocator.num_evictable)],
        )
        metric(
            "cbgen_kv_cache_usage_ratio",
            "gauge",
            "Fraction of KV blocks held by requests.",
            [("", used / total if total else 0.0)],
        )
        metric(
            "cbgen_prompt_tokens_total",
            "counter",
            "Prompt tokens received (once per prompt).",
            [(model, self.prompt_tokens)],
        )
        metric(
            "cbgen_generation_tokens_total",
            "counter",
            "Tokens generated and delivered.",
            [(model, self.generation_tokens)],
        )
        stats = getattr(core, "stats", None) or {}
        metric(
            "cbgen_preemptions_total",
            "counter",
            "Requests preempted for lack of KV blocks.",
            [("", stats.get("preemptions", 0))],
        )
        metric(
            "cbgen_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens read from the prefix cache.",
            [("", stats.get("cached_tokens", 0))],
        )
        metric(
            "cbgen_requests_finished_total",
            "counter",
            "Generations (one per choice) by finish reason.",
            [(f'{{finish_reason="{_escape(k)}"}}', v) for k, v in sorted(self.finished.items())],
        )
        metric(
            "cbgen_client_disconnects_total",
            "counter",
            "API calls whose client went away before the answer; their requests were cancelled.",
            [("", self.disconnects)],
        )
        metric(
            "cbgen_http_requests_total",
            "counter",
            "API calls by endpoint and status code.",
            [
                (f'{{endpoint="{_escape(e)}",status="{s}"}}', v)
                for (e, s), v in sorted(self.http.items())
            ],
        )
        self.ttft.render(lines)
        self.itl.render(lines)
        self.e2e.render(lines)
        return "\n".join(lines) + "\n"
