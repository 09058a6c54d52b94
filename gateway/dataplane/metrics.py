"""The gateway's own Prometheus families (served on the data plane's /metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase


class Metrics:
    """The gateway's Prometheus families, on a registry of this process's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered, by model and status code",
            ["model", "code"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmgw_gateway_tokens",
            "Tokens the engines reported, by model and kind",
            ["model", "kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmgw_gateway_ttft_seconds",
            "Time from the request to its first byte from the replica",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmgw_gateway_request_seconds",
            "Time from the request to its last byte",
            ["model"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "llmgw_gateway_inflight", "Requests in flight to each replica", ["replica"], registry=self.registry
        )
        self.ejected = Gauge(
            "llmgw_gateway_replica_ejected",
            "1 while a replica is ejected after repeated failures",
            ["replica"],
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "llmgw_gateway_redis_errors",
            "Calls to Redis that failed and were answered without it, by what they were for (limits, budgets)",
            ["op"],
            registry=self.registry,
        )
        for op in ("limits", "budgets", "inflight"):
            self.redis_errors.labels(op)
        self.counters_local = Gauge(
            "llmgw_gateway_counters_local",
            "1 while Redis does not answer and this process counts limits and budgets on its own",
            registry=self.registry,
        )
        self.retries = Counter(
            "llmgw_gateway_retries", "Requests retried on another replica before the first byte", registry=self.registry
        )
        self.upstream_failures = Counter(
            "llmgw_gateway_upstream_failures",
            "Replicas' failures before an answer, by model and kind (refused, timeout, connection, protocol, http_5xx)",
            ["model", "kind"],
            registry=self.registry,
        )
        # An engine that closes kept-alive connections after its answers (llama.cpp's server after a
        # streamed one) shows here: each is a request that waited for a second connect.
        self.upstream_reopened = Counter(
            "llmgw_gateway_upstream_reopened",
            "Requests sent again on a new connection because the kept-alive one was found closed before any answer",
            registry=self.registry,
        )
        self.held = Gauge(
            "llmgw_gateway_held_requests",
            "Requests held for a model with no ready replica while one starts (autoscaled, at zero)",
            ["model"],
            registry=self.registry,
        )
        self.hold_seconds = Histogram(
            "llmgw_gateway_hold_seconds",
            "Time a held request waited for a replica, by outcome (routed, refused)",
            ["model", "outcome"],
            buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )

    def child(self, family: MetricWrapperBase, *labels: str) -> Any:
        """`family.labels(*labels)`, kept: a family's lookup takes a lock and checks its labels every time.

        No family of the data plane's removes a child, so a kept one is the registry's own.
        """
        key = (family, labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = family.labels(*labels)
        return got
