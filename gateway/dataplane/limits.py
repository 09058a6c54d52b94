"""API keys' per-minute limits (requests, tokens), counted in Redis so that every gateway process agrees."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.table import KeyEntry


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
    """Per-key, per-minute counters: Redis when there is one (shared), this process's memory otherwise."""

    redis: aioredis.Redis | None
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
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incr(rpm_k)
            pipe.expire(rpm_k, 120)
            pipe.get(tpm_k)
            requests, _, tokens = await pipe.execute()
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
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incrby(k, tokens)
            pipe.expire(k, 120)
            await pipe.execute()
        else:
            self.local[k] += tokens
