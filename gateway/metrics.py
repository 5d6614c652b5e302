"""Prometheus metrics of the gateway, served at `GET /metrics` (text exposition format).

Counters and the latency histogram are updated on the request path; gauges of live state (calls
in flight per replica, calls waiting at the pause gate) are read from the gateway only when
scraped, so they cost nothing per call. Each gateway has its own registry: two gateways in one
process (tests) never share counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import GatewayStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; from a fast admin call to a long generation.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _LiveState(Collector):
    """Gauges read from the gateway's status at scrape time."""

    def __init__(self, status: Callable[[], GatewayStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._status()
        waiting = GaugeMetricFamily(
            "lockgate_gateway_gate_waiting", "Calls waiting at the pause gate for a sync to end."
        )
        waiting.add_metric([], status.waiting)
        yield waiting
        segments = GaugeMetricFamily(
            "lockgate_gateway_segments_in_flight", "Upstream generation requests in flight."
        )
        segments.add_metric([], status.in_flight)
        yield segments
        per_replica = GaugeMetricFamily(
            "lockgate_gateway_replica_in_flight",
            "Generation requests in flight, per replica.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "lockgate_gateway_replica_healthy",
            "1 if the replica is in rotation (healthy and not stale).",
            labels=["replica"],
        )
        held = GaugeMetricFamily(
            "lockgate_gateway_replica_version",
            "Weight version each replica holds for this gateway, labelled in adapter mode with "
            "the adapter its calls use there (empty at version 0, the base model).",
            labels=["replica", "adapter"],
        )
        for replica in status.replicas:
            per_replica.add_metric([replica.url], replica.in_flight)
            healthy.add_metric([replica.url], float(replica.healthy and not replica.stale))
            held.add_metric([replica.url, replica.adapter or ""], replica.version)
        yield per_replica
        yield healthy
        yield held
        version = GaugeMetricFamily("lockgate_gateway_weight_version", "Weight version served.")
        version.add_metric([], status.version)
        yield version


class GatewayMetrics:
    def __init__(self, status: Callable[[], GatewayStatus]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "lockgate_gateway_requests",
            "HTTP requests answered, by route template and status code.",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "lockgate_gateway_request_seconds",
            "Time from request to the end of the answer (the last byte of a stream), by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lockgate_gateway_prompt_tokens", "Prompt tokens of recorded calls.", registry=r
        )
        self.completion_tokens = Counter(
            "lockgate_gateway_completion_tokens",
            "Sampled tokens of recorded calls (interrupted ones included).",
            registry=r,
        )
        self.calls = Counter(
            "lockgate_gateway_calls",
            "Recorded calls, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rerender_splits = Counter(
            "lockgate_gateway_rerender_splits",
            "Calls after a session's first whose prompt did not extend the previous call's tokens.",
            registry=r,
        )
        self.interruptions = Counter(
            "lockgate_gateway_interruptions",
            "Times calls were cut by a weight sync and continued (or failed).",
            registry=r,
        )
        self.failovers = Counter(
            "lockgate_gateway_failovers",
            "Times calls moved to another replica after one failed mid-call.",
            registry=r,
        )
        self.errors = Counter(
            "lockgate_gateway_errors",
            "Errors answered to clients, by kind (the OpenAI error code, else its type).",
            ["kind"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "lockgate_gateway_loop_lag_seconds",
            "How late the event loop woke a heartbeat that sleeps 0.1 s at a time.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        r.register(_LiveState(status))
        self._answered: dict[tuple[str, int], tuple[Any, Any]] = {}

    def answered(self, route: str, status: int, seconds: float) -> None:
        """One HTTP request answered: counted by route template and status, and timed."""
        key = (route, status)
        children = self._answered.get(key)
        if children is None:
            # Label lookups take the registry's lock and build a key: done once per label set.
            children = (self.requests.labels(route, str(status)), self.latency.labels(route))
            self._answered[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def error(self, exc: GatewayError) -> None:
        self.errors.labels(exc.code or exc.type).inc()

    def call(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        rerender_split: bool,
        interruptions: int,
        failovers: int,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.calls.labels(finish_reason).inc()
        if rerender_split:
            self.rerender_splits.inc()
        if interruptions:
            self.interruptions.inc(interruptions)
        if failovers:
            self.failovers.inc(failovers)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP request by route template and status.

    The route is the matched path template (`/sessions/{session_id}/v1/chat/completions`), never
    the raw path, so session ids do not become label values; unmatched paths count as
    `unmatched`. Latency runs to the end of the response body, streams included.
    """

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.answered(path, status, time.perf_counter() - started)
