"""Per-replica figures the data planes share for the admin: engine load and cache, in-flight, ejection.

Each data plane writes what it sees after every scrape into one Redis hash
(replica id -> JSON) that expires unless renewed, so the admin shows what a
gateway saw within the last seconds, and nothing once no gateway runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import redis
from django.conf import settings

TTL_S = 30

_client: redis.Redis | None = None


@dataclass(frozen=True)
class Figures:
    """What one gateway process saw of one replica."""

    running: float | None
    waiting: float | None
    kv_usage: float | None
    hit_ratio: float | None
    inflight: int
    # Seconds of ejection left (0: not ejected) and failures in a row.
    ejected_for_s: float
    failures: int


def _key() -> str:
    return f"{settings.LLMGW_CACHE_PREFIX}:gateway:replicas"


async def publish_async(client: Any, rows: dict[str, Figures]) -> None:
    """Write a data plane's figures (asyncio Redis client)."""
    if not rows:
        return
    pipe = client.pipeline(transaction=False)
    pipe.hset(_key(), mapping={rid: json.dumps(asdict(f)) for rid, f in rows.items()})
    pipe.expire(_key(), TTL_S)
    await pipe.execute()


def read() -> dict[str, Figures]:
    """The figures the gateways last shared, by replica id (empty without Redis or a running gateway)."""
    global _client
    if not settings.REDIS_URL:
        return {}
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    try:
        raw = _client.hgetall(_key())
    except redis.RedisError:
        return {}
    out = {}
    for rid, data in raw.items():
        try:
            out[rid.decode()] = Figures(**json.loads(data))
        except (ValueError, TypeError):
            continue
    return out
