"""Momentary telemetry: load, sensors, wear, IB ports and their rates.

It describes a moment, so it lives in the cache (Redis in production) with a
TTL, never in a table row per heartbeat; a restored value would be stale.
One key per node holds the latest heartbeat's telemetry as plain JSON-able
data; readers fetch many nodes in one round trip.

Telemetry is best effort: a cache that is down or slow must never cost a
node its lease (the heartbeat's database work commits whatever the cache
does), so every call here swallows the cache's errors, logs them, counts them
in `llmgw_telemetry_cache_errors_total{op}` and answers "not reported".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.conf import settings
from django.core.cache import cache
from prometheus_client import Counter

log = logging.getLogger(__name__)
T = TypeVar("T")

CACHE_ERRORS = Counter(
    "llmgw_telemetry_cache_errors",
    "Cache operations that failed (the cache was down or slow) and were skipped or answered without it",
    ["op"],
)
# Every operation present from the start at 0, so a rate is defined before the first failure.
for _op in ("get", "get_many", "put", "forget", "doctor", "doctor_baselines", "inflight", "sweep_schedule"):
    CACHE_ERRORS.labels(op=_op)


def _failed(op: str, exc: Exception) -> None:
    CACHE_ERRORS.labels(op=op).inc()
    log.warning("telemetry cache %s skipped: %s: %s", op, type(exc).__name__, exc)


_PREFIX = "telemetry:"
# Beside each entry, the digest of the status it was made from (inventory/heartbeat.py status_digest):
# a status floor sent as that digest is checked against this small value, never the whole entry.
_DIGEST_PREFIX = "status-digest:"


def best_effort(op: str, call: Callable[[], T], default: T) -> T:
    """Run one cache call; on any failure log and count it under `op` and return `default`.

    For every reader and writer of momentary data (telemetry, the doctor's
    baselines and its cached results): a cache outage costs them freshness,
    never a request.
    """
    try:
        return call()
    except Exception as exc:  # any cache failure: the moment is lost, nothing else
        _failed(op, exc)
        return default


def key(node_id: str) -> str:
    """The cache key of a node's telemetry."""
    return f"{_PREFIX}{node_id}"


def digest_key(node_id: str) -> str:
    """The cache key of the digest of the status a node's telemetry was made from."""
    return f"{_DIGEST_PREFIX}{node_id}"


def put(node_id: str, data: dict[str, Any], *, digest: str | None = None) -> None:
    """Store a node's latest telemetry, and with `digest` the digest of the status it came from (one round trip).

    Without `digest` the stored digest is left as it is (an entry rewritten
    from itself, not from a new status).

    Shape: {"at": server time (unix s), "agent_at": agent clock or None,
    "load": wire.Load dict or None, "gpus": [wire.GPUSensor dicts],
    "ib_ports": [wire.IBPort dicts, each with "tx_bps" and "rx_bps" in bits a second],
    "shards": [{"shard_id", "state"}], "applied": fingerprints of the durable reports
    last written (inventory/heartbeat.py digest, keyed "fabrics" and "installs")}.
    """
    try:
        if digest is None:
            cache.set(key(node_id), data, timeout=settings.LLMGW_TELEMETRY_TTL)
        else:
            cache.set_many({key(node_id): data, digest_key(node_id): digest}, timeout=settings.LLMGW_TELEMETRY_TTL)
    except Exception as exc:  # any cache failure: the moment is lost, nothing else
        _failed("put", exc)


def get(node_id: str) -> dict[str, Any] | None:
    """A node's latest telemetry, None when there is none (or it expired, or the cache is unreachable)."""
    try:
        return cache.get(key(node_id))
    except Exception as exc:
        _failed("get", exc)
        return None


def get_many(node_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Telemetry of many nodes in one round trip, by node id (absent ones left out)."""
    ids = list(node_ids)
    if not ids:
        return {}
    try:
        found = cache.get_many([key(i) for i in ids])
    except Exception as exc:
        _failed("get_many", exc)
        return {}
    return {k[len(_PREFIX) :]: v for k, v in found.items()}


def forget(node_id: str) -> None:
    """Drop a node's telemetry and its status's digest (a forgotten node); both expire by themselves otherwise."""
    try:
        cache.delete_many([key(node_id), digest_key(node_id)])
    except Exception as exc:
        _failed("forget", exc)
