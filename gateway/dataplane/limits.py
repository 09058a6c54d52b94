"""API keys' per-minute limits (requests, tokens), counted in Redis so that every gateway process agrees.

Redis is an accelerator, not a dependency: while it does not answer, each
process counts the limits (and the budgets, budgets.py) in its own memory,
so a key may get up to its limit from each process instead of one between
them all, rather than a 500 for every request. The degradation is visible:
`llmgw_gateway_counters_local` is 1 meanwhile, every failed call is counted
in `llmgw_gateway_redis_errors_total{op}`, and the change both ways is
logged. Redis is asked again after RETRY_S, not on every request, so a hung
one costs a request at most the client's timeout once in that while.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dataplane.metrics import Metrics
from gateway.table import KeyEntry

log = logging.getLogger("gateway.dataplane")

# Seconds between attempts at a Redis that failed.
RETRY_S = 5.0


@dataclass
class Shared:
    """Whether the shared counters (Redis) answer; calls through it fall back to None when they do not."""

    redis: aioredis.Redis | None
    metrics: Metrics | None = None
    # monotonic time before which Redis is not asked again; 0.0 while it answers.
    down_until: float = 0.0
    down: bool = False

    async def call(self, op: str, run: Callable[[aioredis.Redis], Awaitable[Any]]) -> Any | None:
        """run(redis)'s result; None when there is no Redis or it failed (then counted, and logged once)."""
        if self.redis is None or (self.down and time.monotonic() < self.down_until):
            return None
        try:
            result = await run(self.redis)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(op, exc)
            return None
        if self.down:
            self.down = False
            log.warning("gateway: Redis answers again: limits and budgets are shared by every gateway process")
            if self.metrics is not None:
                self.metrics.counters_local.set(0)
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self.down_until = time.monotonic() + RETRY_S
        if self.metrics is not None:
            self.metrics.redis_errors.labels(op).inc()
            self.metrics.counters_local.set(1)
        if not self.down:
            self.down = True
            log.warning(
                "gateway: Redis unreachable (%s: %s): limits and budgets are counted by this process alone "
                "until it answers",
                type(exc).__name__,
                exc,
            )


def duration(seconds: float) -> str:
    """A wait in OpenAI's duration form, as its x-ratelimit-reset-* headers carry it: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass(frozen=True)
class Window:
    """A key's minute as one admission left it: what it may do, what it has used, when it starts afresh."""

    rpm_limit: int
    # Requests this minute, this one included.
    requests: int
    tpm_limit: int
    # Tokens this minute before this request (its own are counted when it ends).
    tokens: int
    # Seconds until the minute ends.
    reset: float
    # Seconds to wait before asking again; None: admitted.
    retry_after: float | None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers, a trio for each limit the key has."""
        out: list[tuple[bytes, bytes]] = []
        reset = duration(self.reset).encode()
        for kind, limit, used in (("requests", self.rpm_limit, self.requests), ("tokens", self.tpm_limit, self.tokens)):
            if limit:
                out += [
                    (b"x-ratelimit-limit-" + kind.encode(), str(limit).encode()),
                    (b"x-ratelimit-remaining-" + kind.encode(), str(max(0, limit - used)).encode()),
                    (b"x-ratelimit-reset-" + kind.encode(), reset),
                ]
        return out


@dataclass
class Limiter:
    """Per-key, per-minute counters: Redis while it answers (shared), this process's memory otherwise."""

    shared: Shared
    prefix: str
    local: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _k(self, kind: str, key_id: int, minute: int) -> str:
        return f"{self.prefix}:gw:{kind}:{key_id}:{minute}"

    async def admit(self, key: KeyEntry, now: float) -> Window | None:
        """Count a request against its key: its minute (retry_after set when over a limit), None for a key without."""
        if not key.rpm_limit and not key.tpm_limit:
            return None
        minute = int(now // 60)
        reset = 60 - (now % 60)
        rpm_k, tpm_k = self._k("rpm", key.id, minute), self._k("tpm", key.id, minute)

        async def counted(r: aioredis.Redis) -> list:
            pipe = r.pipeline(transaction=False)
            pipe.incr(rpm_k)
            pipe.expire(rpm_k, 120)
            pipe.get(tpm_k)
            return await pipe.execute()

        got = await self.shared.call("limits", counted)
        if got is not None:
            requests, _, tokens = got
            tokens = int(tokens or 0)
        else:
            self.local[rpm_k] += 1
            requests, tokens = self.local[rpm_k], self.local.get(tpm_k, 0)
        over = (key.rpm_limit and int(requests) > key.rpm_limit) or (key.tpm_limit and tokens >= key.tpm_limit)
        return Window(key.rpm_limit, int(requests), key.tpm_limit, tokens, reset, reset if over else None)

    async def spend(self, key: KeyEntry, tokens: int, now: float) -> None:
        """Add a finished request's tokens to its key's minute."""
        if not key.tpm_limit or tokens <= 0:
            return
        k = self._k("tpm", key.id, int(now // 60))

        async def add(r: aioredis.Redis) -> list:
            pipe = r.pipeline(transaction=False)
            pipe.incrby(k, tokens)
            pipe.expire(k, 120)
            return await pipe.execute()

        if await self.shared.call("limits", add) is None:
            self.local[k] += tokens
