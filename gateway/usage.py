"""Usage per key, model and minute: summed in each data plane's memory, written in batches.

A data plane adds every finished request to an in-memory accumulator and
writes what it holds every LLMGW_GATEWAY_USAGE_FLUSH seconds (and when it stops) as one
upsert that adds to the minute's row, so several gateway processes sum into
the same rows and no request ever costs a database write of its own.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.db import connection, transaction

from gateway.models import ApiKey, UsageMinute

Slot = tuple[int, str, int]  # key id, model, minute (Unix seconds // 60)


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
