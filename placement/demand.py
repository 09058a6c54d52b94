"""Demand per served model, as every router (the gateway's data planes) reports it: the autoscaler's signals.

Beside its requests in flight per replica (placement/inflight.py), each
router process writes, per model, the requests it holds because no replica
is ready (a model at zero replicas waiting for one to start) and the
time to first token of its recent requests. They live in Redis under the
same short TTL, so a router that dies stops counting within seconds, and the
reconciler sums them over every live router: the decision is made once,
from what all gateways saw. Placement owns the format; the routers import it.

The embedded default has no Redis: each router writes a file of its own
under the var directory, replaced whole, as for in-flight counts.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from django.conf import settings

from inventory import telemetry
from placement.inflight import REPORT_TTL_S, fresh_reports, write_report

log = logging.getLogger(__name__)

# The TTFT samples a router keeps per model: the last this many seconds, at most this many.
TTFT_WINDOW_S = 60.0
TTFT_SAMPLES = 200

_client: redis.Redis | None = None


def _prefix() -> str:
    return f"{settings.LLMGW_CACHE_PREFIX}:demand:"


@dataclass(frozen=True)
class ModelDemand:
    """One router's (or the sum of every router's) figures for one model."""

    held: int = 0
    ttft: tuple[float, ...] = ()
    # Requests waiting at the model's engines, summed over its replicas, as the router last
    # scraped them (None: no engine says). Every router scrapes every replica, so
    # routers' figures are merged by their maximum, not summed.
    waiting: float | None = None

    def to_json(self) -> str:
        """The report's wire form."""
        return json.dumps({"held": self.held, "ttft": [round(t, 4) for t in self.ttft], "waiting": self.waiting})

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelDemand:
        """A report read back (bad data reads as nothing)."""
        try:
            data = json.loads(raw)
            waiting = data.get("waiting")
            return cls(
                int(data.get("held", 0)),
                tuple(float(t) for t in data.get("ttft", ())),
                None if waiting is None else float(waiting),
            )
        except (ValueError, TypeError, AttributeError):
            return cls()


@dataclass
class Totals:
    """Every live router's demand, by model."""

    routers: int = 0
    per_model: dict[str, ModelDemand] = field(default_factory=dict)
    # False when the reports could not be read (Redis unreachable).
    known: bool = True

    def add(self, model: str, d: ModelDemand) -> None:
        """Sum one router's report into the totals."""
        old = self.per_model.get(model, ModelDemand())
        seen = [w for w in (old.waiting, d.waiting) if w is not None]
        self.per_model[model] = ModelDemand(old.held + d.held, old.ttft + d.ttft, max(seen) if seen else None)

    def waiting(self, model: str) -> float | None:
        """Requests waiting at the model's engines (the highest any router saw), None when unknown."""
        return self.per_model.get(model, ModelDemand()).waiting

    def held(self, model: str) -> int:
        """Requests held for `model` over every router."""
        return self.per_model.get(model, ModelDemand()).held

    def ttft_p95(self, model: str) -> float | None:
        """The p95 of every router's recent TTFT samples for `model` (nearest rank); None when there are none."""
        return p95(self.per_model.get(model, ModelDemand()).ttft)


def p95(samples: tuple[float, ...] | list[float]) -> float | None:
    """The 95th percentile by nearest rank; None for no samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


async def report_async(client: Any, process_id: str, per_model: Mapping[str, ModelDemand] | None) -> None:
    """Replace one router's demand report; None withdraws it (the router is stopping)."""
    key = _prefix() + process_id
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    if per_model:
        pipe.hset(key, mapping={m: d.to_json() for m, d in per_model.items()})
        pipe.expire(key, REPORT_TTL_S)
    await pipe.execute()


def _reports_dir() -> Path:
    return Path(settings.VAR_DIR) / "demand"


def report_file(process_id: str, per_model: Mapping[str, ModelDemand] | None, *, now: float | None = None) -> None:
    """The embedded default's report_async: one file per router, replaced whole; None or empty removes it."""
    body = None
    if per_model:
        body = {"at": time.time() if now is None else now, "models": {m: d.to_json() for m, d in per_model.items()}}
    write_report(_reports_dir(), process_id, body)


def totals(*, now: float | None = None) -> Totals:
    """Every live router's demand summed by model (Redis, or the embedded default's files)."""
    global _client
    out = Totals()
    if not settings.REDIS_URL:
        now = time.time() if now is None else now
        for report in fresh_reports(_reports_dir(), now=now):
            out.routers += 1
            for model, raw in report.get("models", {}).items():
                out.add(model, ModelDemand.from_json(raw))
        return out
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    try:
        keys = list(_client.scan_iter(match=_prefix() + "*", count=100))
        if not keys:
            return out
        pipe = _client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        reports = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        # Redis is an accelerator: unreadable reports are "unknown", never a failed pass.
        telemetry.CACHE_ERRORS.labels(op="inflight").inc()
        log.warning("demand reports unreadable (%s: %s)", type(exc).__name__, exc)
        return Totals(known=False)
    for report in reports:
        out.routers += 1
        for model, raw in report.items():
            out.add(model.decode(), ModelDemand.from_json(raw))
    return out
