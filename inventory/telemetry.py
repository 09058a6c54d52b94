"""Momentary telemetry: load, sensors, wear, IB ports and their rates.

It describes a moment, so it lives in the cache (Redis in production) with a
TTL, never in a table row per heartbeat; a restored value would be stale.
One key per node holds the latest heartbeat's telemetry as plain JSON-able
data; readers fetch many nodes in one round trip.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.core.cache import cache

_PREFIX = "telemetry:"


def key(node_id: str) -> str:
    """The cache key of a node's telemetry."""
    return f"{_PREFIX}{node_id}"


def put(node_id: str, data: dict[str, Any]) -> None:
    """Store a node's latest telemetry.

    Shape: {"at": server time (unix s), "agent_at": agent clock or None,
    "load": wire.Load dict or None, "gpus": [wire.GPUSensor dicts],
    "ib_ports": [wire.IBPort dicts, each with "tx_bps" and "rx_bps" in bits a second],
    "shards": [{"shard_id", "state"}], "applied": fingerprints of the durable reports
    last written (inventory/heartbeat.py digest, keyed "fabrics" and "installs")}.
    """
    cache.set(key(node_id), data, timeout=settings.LLMGW_TELEMETRY_TTL)


def get(node_id: str) -> dict[str, Any] | None:
    """A node's latest telemetry, None when there is none (or it expired)."""
    return cache.get(key(node_id))


def get_many(node_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Telemetry of many nodes in one round trip, by node id (absent ones left out)."""
    ids = list(node_ids)
    if not ids:
        return {}
    found = cache.get_many([key(i) for i in ids])
    return {k[len(_PREFIX) :]: v for k, v in found.items()}


def forget(node_id: str) -> None:
    """Drop a node's telemetry (a forgotten node)."""
    cache.delete(key(node_id))
