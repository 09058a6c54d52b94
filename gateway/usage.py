"""Usage per key, model and minute: summed in each data plane's memory, written in batches.

A data plane adds every finished request to an in-memory accumulator and
writes what it holds every LLMGW_GATEWAY_USAGE_FLUSH seconds (and when it stops) as one
upsert that adds to the minute's row, so several gateway processes sum into
the same rows and no request ever costs a database write of its own.

Also the reports read back from those rows: a key's spend this UTC day and month (its
budgets), its tokens per day, and usage by key, model and time bucket (the API).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import connection, transaction
from django.db.models import F, Q, Sum
from django.db.models.functions import Coalesce, TruncDay, TruncHour

from gateway.models import ApiKey, UsageMinute

Slot = tuple[int, str, int]  # key id, model, minute (Unix seconds // 60)
BUCKETS = ("minute", "hour", "day")
GROUPS = ("key", "model")
_TOKENS = F("prompt_tokens") + F("completion_tokens")


@dataclass
class Counts:
    """What one slot has added up to since the last flush."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0

    def merge(self, other: Counts) -> None:
        """Add another slot's counts into this one."""
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.errors += other.errors
        self.ttft_seconds_sum += other.ttft_seconds_sum
        self.ttft_count += other.ttft_count


class Accumulator:
    """The counts of one process, by slot, until they are taken for writing."""

    def __init__(self) -> None:
        self.slots: dict[Slot, Counts] = defaultdict(Counts)

    def add(
        self,
        key_id: int,
        model: str,
        at: float,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        error: bool = False,
        ttft: float | None = None,
    ) -> None:
        """Count one finished request (at: Unix time)."""
        c = self.slots[(key_id, model, int(at // 60))]
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.completion_tokens += completion_tokens
        c.errors += int(error)
        if ttft is not None:
            c.ttft_seconds_sum += ttft
            c.ttft_count += 1

    def take(self) -> dict[Slot, Counts]:
        """Everything counted so far; the accumulator starts again empty."""
        out, self.slots = self.slots, defaultdict(Counts)
        return dict(out)

    def put_back(self, rows: dict[Slot, Counts]) -> None:
        """Return rows a failed write could not store, to go with the next flush."""
        for slot, counts in rows.items():
            self.slots[slot].merge(counts)


def write_batch(rows: dict[Slot, Counts]) -> int:
    """Add the rows to their minutes in one statement (PostgreSQL and SQLite upsert); returns the rows written.

    Rows of a key deleted meanwhile are dropped.
    """
    if not rows:
        return 0
    table = UsageMinute._meta.db_table
    sql = (
        f"INSERT INTO {table} (key_id, model, minute, requests, prompt_tokens, completion_tokens, errors,"
        " ttft_seconds_sum, ttft_count) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
        " ON CONFLICT (key_id, model, minute) DO UPDATE SET"
        f" requests = {table}.requests + EXCLUDED.requests,"
        f" prompt_tokens = {table}.prompt_tokens + EXCLUDED.prompt_tokens,"
        f" completion_tokens = {table}.completion_tokens + EXCLUDED.completion_tokens,"
        f" errors = {table}.errors + EXCLUDED.errors,"
        f" ttft_seconds_sum = {table}.ttft_seconds_sum + EXCLUDED.ttft_seconds_sum,"
        f" ttft_count = {table}.ttft_count + EXCLUDED.ttft_count"
    )
    live = set(ApiKey.objects.filter(id__in={k for k, _, _ in rows}).values_list("id", flat=True))
    params = [
        (
            key_id,
            model,
            connection.ops.adapt_datetimefield_value(dt.datetime.fromtimestamp(minute * 60, tz=dt.UTC)),
            c.requests,
            c.prompt_tokens,
            c.completion_tokens,
            c.errors,
            c.ttft_seconds_sum,
            c.ttft_count,
        )
        for (key_id, model, minute), c in sorted(rows.items())
        if key_id in live
    ]
    with transaction.atomic(), connection.cursor() as cur:
        cur.executemany(sql, params)
    return len(params)


def day_start(now: dt.datetime) -> dt.datetime:
    """The start of `now`'s UTC day."""
    return now.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def month_start(now: dt.datetime) -> dt.datetime:
    """The start of `now`'s UTC month."""
    return day_start(now).replace(day=1)


@dataclass(frozen=True)
class Spent:
    """Tokens (prompt + completion) a key has spent in the current UTC day and month, as recorded."""

    day: int = 0
    month: int = 0


def spent(key_ids: Iterable[int], now: dt.datetime) -> dict[int, Spent]:
    """Each key's recorded tokens this UTC day and month (one query; keys with none are left out).

    Recorded means written by the data planes' last flush: up to
    LLMGW_GATEWAY_USAGE_FLUSH seconds behind the requests themselves.
    """
    ids = list(key_ids)
    if not ids:
        return {}
    today = day_start(now)
    rows = (
        UsageMinute.objects.filter(key_id__in=ids, minute__gte=month_start(now))
        .values("key_id")
        .annotate(
            month=Sum(_TOKENS),
            day=Coalesce(Sum(_TOKENS, filter=Q(minute__gte=today)), 0),
        )
    )
    return {r["key_id"]: Spent(day=int(r["day"]), month=int(r["month"])) for r in rows}


def daily_tokens(key_id: int, now: dt.datetime, days: int = 30) -> list[tuple[dt.date, int]]:
    """A key's tokens per UTC day for the `days` days ending today, oldest first, days without use as 0."""
    first = day_start(now) - dt.timedelta(days=days - 1)
    rows = (
        UsageMinute.objects.filter(key_id=key_id, minute__gte=first)
        .annotate(day=TruncDay("minute", tzinfo=dt.UTC))
        .values("day")
        .annotate(tokens=Sum(_TOKENS))
    )
    by_day = {r["day"].date(): int(r["tokens"]) for r in rows}
    return [(d, by_day.get(d, 0)) for d in ((first + dt.timedelta(days=i)).date() for i in range(days))]


def report(
    *,
    start: dt.datetime,
    end: dt.datetime,
    group_by: Iterable[str] = GROUPS,
    bucket: str | None = None,
    key_id: int | None = None,
    model: str | None = None,
) -> list[dict]:
    """Usage in [start, end) summed by `group_by` (key, model) and by `bucket` (minute, hour, day; None: the range).

    One query. Each row has the groups asked for (key_id and key_name for
    key, model), `bucket` (its start, or None), requests, prompt_tokens,
    completion_tokens, total_tokens and errors; ordered by bucket, key, model.
    """
    groups = [g for g in GROUPS if g in set(group_by)]
    qs = UsageMinute.objects.filter(minute__gte=start, minute__lt=end)
    if key_id is not None:
        qs = qs.filter(key_id=key_id)
    if model is not None:
        qs = qs.filter(model=model)
    names: list[str] = []
    if bucket == "minute":
        qs, names = qs.annotate(bucket=F("minute")), ["bucket"]
    elif bucket in ("hour", "day"):
        trunc = TruncHour if bucket == "hour" else TruncDay
        qs, names = qs.annotate(bucket=trunc("minute", tzinfo=dt.UTC)), ["bucket"]
    if "key" in groups:
        names += ["key_id", "key__name"]
    if "model" in groups:
        names.append("model")
    rows = (
        qs.values(*names)
        .annotate(
            n_requests=Sum("requests"),
            n_prompt=Sum("prompt_tokens"),
            n_completion=Sum("completion_tokens"),
            n_errors=Sum("errors"),
        )
        .order_by(*names)
    )
    out = []
    for r in rows:
        row: dict = {"bucket": r["bucket"].astimezone(dt.UTC) if "bucket" in r else None}
        if "key" in groups:
            row["key_id"], row["key_name"] = r["key_id"], r["key__name"]
        if "model" in groups:
            row["model"] = r["model"]
        prompt, completion = int(r["n_prompt"] or 0), int(r["n_completion"] or 0)
        row.update(
            requests=int(r["n_requests"] or 0),
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            errors=int(r["n_errors"] or 0),
        )
        out.append(row)
    return out
