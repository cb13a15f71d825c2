"""Server metrics with ``prometheus-client``, in a registry of the app's own.

Counters and histograms are updated on the server's event-loop thread. Engine gauges
(running and waiting requests, KV blocks, queue bounds) come from
``Engine.snapshot()``, a value the engine's loop thread publishes after every step, so
a scrape never reads the scheduler's lists while the loop changes them. Every label
takes its values from a fixed set (the routes, the finish reasons, the status codes
the server sends), so no client can grow the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no *_created sample per counter: half the output, no use here

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")
OTHER_ROUTE = "other"


def route_label(path: str) -> str:
    """The endpoint label of a path: one of ``ROUTES``, or ``"other"``."""
    return path if path in ROUTES else OTHER_ROUTE


class _EngineCollector(Collector):
    """The engine's gauges and counters, read from its last published snapshot."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        snap = self.engine.snapshot()
        model = [self.model_name]

        def gauge(name: str, help: str, value: float, labelled: bool = False) -> Any:
            family = GaugeMetricFamily(name, help, labels=["model"] if labelled else None)
            if labelled:
                family.add_metric(model, value)
            else:
                family.add_metric([], value)
            return family

        def counter(name: str, help: str, value: float) -> Any:
            family = CounterMetricFamily(name, help)
            family.add_metric([], value)
            return family

        used = snap.num_blocks - snap.num_free_blocks
        yield gauge("cbgen_requests_running", "Requests in the running batch.", snap.running, True)
        yield gauge("cbgen_requests_waiting", "Requests queued for admission.", snap.waiting, True)
        yield gauge(
            "cbgen_queued_requests",
            "Requests added but not started (what max_waiting_requests bounds).",
            snap.queued_requests,
        )
        yield gauge(
            "cbgen_queued_prompt_tokens",
            "Prompt tokens of the requests not started (what max_queued_tokens bounds).",
            snap.queued_tokens,
        )
        yield gauge("cbgen_kv_blocks_total", "KV cache blocks.", snap.num_blocks)
        yield gauge("cbgen_kv_blocks_used", "KV cache blocks held by requests.", used)
        yield gauge(
            "cbgen_kv_blocks_cached_free",
            "Unused KV blocks kept for prefix reuse (evicted on demand).",
            snap.num_evictable_blocks,
        )
        yield gauge(
            "cbgen_kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests.",
            used / snap.num_blocks if snap.num_blocks else 0.0,
        )
        yield counter(
            "cbgen_preemptions", "Requests preempted for lack of KV blocks.", snap.preemptions
        )
        yield counter(
            "cbgen_prefix_cache_hit_tokens",
            "Prompt tokens read from the prefix cache.",
            snap.cached_tokens,
        )
        yield counter(
            "cbgen_streams_aborted_unread",
            "Requests aborted because their stream's consumer stopped reading.",
            snap.unread_aborts,
        )
        yield counter(
            "cbgen_requests_rejected",
            "Requests refused because the queue bounds were reached (429).",
            snap.rejected,
        )
        yield counter(
            "cbgen_spec_proposed_tokens",
            "Speculative guesses verified by the target.",
            snap.spec_proposed_tokens,
        )
        yield counter(
            "cbgen_spec_accepted_tokens",
            "Speculative guesses the target kept.",
            snap.spec_accepted_tokens,
        )
        yield counter(
            "cbgen_spec_verifications",
            "Request-steps that verified at least one guess.",
            snap.spec_verifications,
        )
        verified = snap.spec_verifications
        yield gauge(
            "cbgen_spec_mean_accepted_length",
            "Tokens gained per verification, the sampled one included (0 before any).",
            1 + snap.spec_accepted_tokens / verified if verified else 0.0,
        )


class ServerMetrics:
    """What ``GET /metrics`` reports for one online engine."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.prompt_tokens = Counter(
            "cbgen_prompt_tokens",
            "Prompt tokens received (once per prompt).",
            ["model"],
            registry=registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "cbgen_generation_tokens",
            "Tokens generated and delivered.",
            ["model"],
            registry=registry,
        ).labels(model_name)
        self.finished = Counter(
            "cbgen_requests_finished",
            "Generations (one per choice) by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.http = Counter(
            "cbgen_http_requests",
            "API calls by endpoint (a fixed set of routes, else 'other') and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.disconnects = Counter(
            "cbgen_client_disconnects",
            "API calls whose client went away, or stopped reading, before the answer; "
            "their requests were cancelled.",
            registry=registry,
        )
        self.ttft = Histogram(
            "cbgen_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "cbgen_inter_token_latency_seconds",
            "Time between two consecutive generated tokens of one request.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "cbgen_request_latency_seconds",
            "Time from receiving a request to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
