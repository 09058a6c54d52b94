"""Requests in flight per replica, as whoever routes requests to replicas reports them.

The reconciler stops a retired replica's shards only when nothing is in
flight to it any more (or a timeout passes), so a drain, a scale-down or a
rolling update fails no request. Each router process (the gateway's data
planes) writes its own counts to Redis every fraction of a second under a
short TTL, so a router that dies stops counting within seconds. Placement
owns the format; the routers import it.

The embedded default has no Redis: there each router writes its counts to a
file of its own under the var directory (replaced atomically), and a file not
renewed within the TTL counts as a router gone. Without it the reconciler saw
no router at all and stopped a drained replica at once, cutting the streams
still running on it.

Redis is an accelerator here, not a dependency: when the reports cannot be
read, totals() says so (`known` False) instead of raising, and a retiring
replica waits out LLMGW_DRAIN_REQUESTS_TIMEOUT (placement/retiring.py), as
it would for requests that never end; the pass goes on with everything else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from django.conf import settings

from inventory import telemetry

log = logging.getLogger(__name__)

# A process's report lives this long unless renewed.
REPORT_TTL_S = 3

_client: redis.Redis | None = None


def _prefix() -> str:
    return f"{settings.LLMGW_CACHE_PREFIX}:inflight:"


async def report_async(client: Any, process_id: str, counts: Mapping[str, int] | None) -> None:
    """Replace one router process's counts (replica id -> requests in flight) with `counts`.

    None withdraws the process (it is stopping): it routes nothing any more.
    """
    key = _prefix() + process_id
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    if counts is None:
        await pipe.execute()
        return
    if counts:
        pipe.hset(key, mapping={k: int(v) for k, v in counts.items()})
    else:
        # An empty report still says "this router is alive and has nothing in flight".
        pipe.hset(key, mapping={"-": 0})
    pipe.expire(key, REPORT_TTL_S)
    await pipe.execute()


@dataclass(frozen=True)
class Totals:
    """What the routers said: how many are alive, and their requests in flight per replica."""

    routers: int
    per_replica: dict[str, int]
    # False when the reports could not be read (Redis unreachable): nothing is known about what is in flight.
    known: bool = True


def _reports_dir() -> Path:
    return Path(settings.VAR_DIR) / "inflight"


def report_file(process_id: str, counts: Mapping[str, int] | None, *, now: float | None = None) -> None:
    """The embedded default's report_async: one file per router, replaced whole; None removes it."""
    body = None if counts is None else {"at": time.time() if now is None else now, "counts": dict(counts)}
    write_report(_reports_dir(), process_id, body)


def write_report(directory: Path, process_id: str, body: dict[str, Any] | None) -> None:
    """One router's report in `directory`, replaced whole (a reader never sees half of it); None removes it."""
    path = directory / f"{process_id}.json"
    if body is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{process_id}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def fresh_reports(directory: Path, *, now: float) -> Iterator[dict[str, Any]]:
    """The reports in `directory` written within REPORT_TTL_S of `now`: a router that stopped reporting has left."""
    for path in directory.glob("*.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if now - float(report.get("at", 0)) <= REPORT_TTL_S:
            yield report


def _file_totals(now: float) -> Totals:
    routers, out = 0, {}
    for report in fresh_reports(_reports_dir(), now=now):
        routers += 1
        for rid, n in report.get("counts", {}).items():
            out[rid] = out.get(rid, 0) + int(n)
    return Totals(routers, out)


def totals(*, now: float | None = None) -> Totals:
    """Requests in flight per replica over every live router (Redis, or the embedded default's files).

    Never raises for Redis: unreadable reports are logged, counted in
    llmgw_telemetry_cache_errors_total{op="inflight"} and answered with
    `known` False.
    """
    global _client
    if not settings.REDIS_URL:
        return _file_totals(time.time() if now is None else now)
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    try:
        return _redis_totals(_client)
    except (redis.RedisError, OSError) as exc:
        telemetry.CACHE_ERRORS.labels(op="inflight").inc()
        log.warning(
            "in-flight reports unreadable (%s: %s): retiring replicas wait out the drain timeout",
            type(exc).__name__,
            exc,
        )
        return Totals(0, {}, known=False)


def _redis_totals(client: redis.Redis) -> Totals:
    out: dict[str, int] = {}
    keys = list(client.scan_iter(match=_prefix() + "*", count=100))
    if not keys:
        return Totals(0, out)
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hgetall(k)
    for counts in pipe.execute():
        for rid, n in counts.items():
            rid = rid.decode()
            if rid != "-":
                out[rid] = out.get(rid, 0) + int(n)
    return Totals(len(keys), out)
