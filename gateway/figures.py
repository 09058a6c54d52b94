"""Per-replica figures the data planes share for the admin: engine load and cache, in-flight, ejection.

Each data plane writes what it sees after every scrape into one Redis hash
(replica id -> JSON) that expires unless renewed, so the admin shows what a
gateway saw within the last seconds, and nothing once no gateway runs.

The embedded default has no Redis: there each replica's figures are an
entry of their own in Django's cache (the file cache the gateway, the web
process and the worker share), under the same TTL. The admin then asks for
the replicas it lists, since a file cache cannot list its keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import redis
from django.conf import settings
from django.core.cache import cache

TTL_S = 30
# What the admin says when no gateway shared anything, instead of "-" in every column.
NONE_SHARED = (
    f"No gateway has shared its figures in the last {TTL_S} s, so the columns below are empty: "
    "they come from a running gateway (make run starts one) within a scrape of it starting."
)

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


def _cache_key(replica_id: str) -> str:
    return f"gateway:replica:{replica_id}"


def publish_cache(rows: Mapping[str, Figures]) -> None:
    """Write a data plane's figures without Redis: one cache entry per replica (blocking: call from a thread)."""
    if rows:
        cache.set_many({_cache_key(rid): asdict(f) for rid, f in rows.items()}, TTL_S)


def read(replica_ids: Iterable[str] | None = None) -> dict[str, Figures]:
    """The figures the gateways last shared, by replica id (empty when no gateway shared any lately).

    Without Redis only the replicas named in `replica_ids` are looked up.
    """
    global _client
    if not settings.REDIS_URL:
        wanted = {_cache_key(rid): rid for rid in replica_ids or ()}
        found = cache.get_many(list(wanted)) if wanted else {}
        return {wanted[k]: Figures(**v) for k, v in found.items()}
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
