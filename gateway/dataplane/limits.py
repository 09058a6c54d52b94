"""API keys' per-minute limits (requests, tokens), counted in Redis so that every gateway process agrees."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.table import KeyEntry


@dataclass
class Limiter:
    """Per-key, per-minute counters: Redis when there is one (shared), this process's memory otherwise."""

    redis: aioredis.Redis | None
    prefix: str
    local: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _k(self, kind: str, key_id: int, minute: int) -> str:
        return f"{self.prefix}:gw:{kind}:{key_id}:{minute}"

    async def admit(self, key: KeyEntry, now: float) -> float | None:
        """Count a request against its key; the seconds to wait (Retry-After) when over a limit, else None."""
        if not key.rpm_limit and not key.tpm_limit:
            return None
        minute = int(now // 60)
        retry = 60 - (now % 60)
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
        if key.rpm_limit and int(requests) > key.rpm_limit:
            return retry
        if key.tpm_limit and tokens >= key.tpm_limit:
            return retry
        return None

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
