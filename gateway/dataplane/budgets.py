"""API keys' token budgets per UTC day and month, judged at admission with no database work per request.

Spend is counted as the per-minute limits count (limits.py): Redis counters
shared by every gateway process, one per key and period (the UTC day, the
UTC month), each expiring an hour after its period ends; this process's
memory when there is no Redis or it does not answer (limits.py: Shared). A finished request adds its prompt and
completion tokens; a request is refused once the spend has reached the
budget, so the request that crosses it finishes, and the next one is refused.

A counter can lose what the database knows (Redis restarted, a gateway
without Redis sees only its own requests): the key table carries each
budgeted key's recorded spend, read with the keys every
LLMGW_GATEWAY_REFRESH seconds (gateway/table.py), and the spend judged is the
larger of the two.

A refusal is a 429 in OpenAI's error shape with type and code
"insufficient_quota" (the code OpenAI's own clients know as "stop, this
does not heal by retrying soon"), the reset time in the message, and
Retry-After in seconds until then. When both budgets are spent, the later
reset (the month's) is the one that matters and is the one given.
"""

from __future__ import annotations

import calendar
import datetime as dt
import math
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.dataplane.http import error_body
from gateway.dataplane.limits import Shared
from gateway.table import KeyEntry

# A counter outlives its period by this much, so a request at the boundary still reads it.
EXPIRY_MARGIN_S = 3600


def period_ends(now: float) -> tuple[int, float, int, float]:
    """The UTC day and month of `now` (Unix seconds): (day id, day's end, month id, month's end)."""
    t = dt.datetime.fromtimestamp(now, tz=dt.UTC)
    day = int(now // 86400)
    month = t.year * 12 + t.month - 1
    days = calendar.monthrange(t.year, t.month)[1]
    month_end = dt.datetime(t.year, t.month, 1, tzinfo=dt.UTC) + dt.timedelta(days=days)
    return day, (day + 1) * 86400.0, month, month_end.timestamp()


@dataclass(frozen=True)
class Refusal:
    """The 429 a spent budget is answered with: its body, its headers and the reset (Unix seconds)."""

    body: bytes
    headers: list[tuple[bytes, bytes]]
    resets_at: float


def refusal(key: KeyEntry, period: str, budget: int, spent: int, resets_at: float, now: float) -> Refusal:
    """The answer to a request of a key whose budget for `period` ("day" or "month") is spent."""
    reset = dt.datetime.fromtimestamp(resets_at, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    message = (
        f"API key {key.name!r} has used its budget of {budget} tokens for this UTC {period}"
        f" ({spent} spent); it resets at {reset}"
    )
    retry = max(1, math.ceil(resets_at - now))
    return Refusal(
        body=error_body(429, message, "insufficient_quota", "insufficient_quota"),
        headers=[(b"retry-after", str(retry).encode())],
        resets_at=resets_at,
    )


@dataclass
class Budgets:
    """Per-key day and month spend: Redis when there is one and it answers (shared), this process's memory otherwise."""

    shared: Shared
    prefix: str
    # Without Redis: (kind, key id) -> (period id, tokens), so a new period starts from zero.
    local: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def _k(self, kind: str, key_id: int, period: int) -> str:
        return f"{self.prefix}:gw:budget:{kind}:{key_id}:{period}"

    async def _counted(self, key_id: int, day: int, month: int) -> tuple[int, int]:
        keys = (self._k("day", key_id, day), self._k("month", key_id, month))
        got = await self.shared.call("budgets", lambda r: r.mget(*keys))
        if got is not None:
            return int(got[0] or 0), int(got[1] or 0)
        d = self.local.get(("day", key_id))
        m = self.local.get(("month", key_id))
        return (d[1] if d and d[0] == day else 0), (m[1] if m and m[0] == month else 0)

    async def admit(self, key: KeyEntry, now: float) -> Refusal | None:
        """None when the key may go on; the 429 to answer when its month's or day's budget is spent."""
        if not key.tokens_per_day and not key.tokens_per_month:
            return None
        day, day_end, month, month_end = period_ends(now)
        counted_day, counted_month = await self._counted(key.id, day, month)
        today = dt.datetime.fromtimestamp(now, tz=dt.UTC).date()
        on = key.recorded_on
        # What the database held when the keys were loaded counts only within its own day and month.
        recorded_day = key.recorded.day if on == today else 0
        same_month = on is not None and (on.year, on.month) == (today.year, today.month)
        recorded_month = key.recorded.month if same_month else 0
        spent_month = max(counted_month, recorded_month)
        if key.tokens_per_month and spent_month >= key.tokens_per_month:
            return refusal(key, "month", key.tokens_per_month, spent_month, month_end, now)
        spent_day = max(counted_day, recorded_day)
        if key.tokens_per_day and spent_day >= key.tokens_per_day:
            return refusal(key, "day", key.tokens_per_day, spent_day, day_end, now)
        return None

    async def spend(self, key: KeyEntry, tokens: int, now: float) -> None:
        """Add a finished request's tokens to its key's day and month."""
        if tokens <= 0 or (not key.tokens_per_day and not key.tokens_per_month):
            return
        day, day_end, month, month_end = period_ends(now)
        dk, mk = self._k("day", key.id, day), self._k("month", key.id, month)

        async def add(r: aioredis.Redis) -> list:
            pipe = r.pipeline(transaction=False)
            # Relative expiries: the period's end is this gateway's clock, and Redis's may differ.
            pipe.incrby(dk, tokens)
            pipe.expire(dk, math.ceil(day_end - now) + EXPIRY_MARGIN_S)
            pipe.incrby(mk, tokens)
            pipe.expire(mk, math.ceil(month_end - now) + EXPIRY_MARGIN_S)
            return await pipe.execute()

        if await self.shared.call("budgets", add) is not None:
            return
        for kind, period in (("day", day), ("month", month)):
            was = self.local.get((kind, key.id))
            self.local[(kind, key.id)] = (period, (was[1] if was and was[0] == period else 0) + tokens)
