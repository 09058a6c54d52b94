"""Usage: summed in memory per key, model and minute, written as additive upserts."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway import keys, usage
from gateway.models import UsageMinute

pytestmark = pytest.mark.django_db


def test_batches_add_to_the_same_minute_rows(operator, now, django_assert_num_queries):
    key, _ = keys.create_key(name="k", owner=operator, now=now)
    t = now.timestamp()  # 12:00:00
    a, b = usage.Accumulator(), usage.Accumulator()  # two gateway processes
    a.add(key.id, "demo", t + 1, prompt_tokens=3, completion_tokens=2, ttft=0.5)
    a.add(key.id, "demo", t + 59, prompt_tokens=1, completion_tokens=1, error=True)
    a.add(key.id, "demo", t + 60, prompt_tokens=7)
    a.add(key.id, "other", t, completion_tokens=4, ttft=0.1)
    b.add(key.id, "demo", t + 30, prompt_tokens=10, completion_tokens=10, ttft=1.5)
    with django_assert_num_queries(4):  # live keys, savepoint, the upsert, release
        assert usage.write_batch(a.take()) == 3
    assert a.take() == {}
    usage.write_batch(b.take())
    rows = {
        (r.model, r.minute): (r.requests, r.prompt_tokens, r.completion_tokens, r.errors, r.ttft_count, r.mean_ttft_ms)
        for r in UsageMinute.objects.all()
    }
    m0, m1 = now, now + dt.timedelta(minutes=1)
    assert rows == {
        ("demo", m0): (3, 14, 13, 1, 2, 1000.0),
        ("demo", m1): (1, 7, 0, 0, 0, None),
        ("other", m0): (1, 0, 4, 0, 1, pytest.approx(100.0)),
    }


def test_put_back_merges_into_the_next_flush(operator, now):
    key, _ = keys.create_key(name="k", owner=operator, now=now)
    acc = usage.Accumulator()
    acc.add(key.id, "demo", now.timestamp(), prompt_tokens=2)
    taken = acc.take()
    acc.add(key.id, "demo", now.timestamp(), prompt_tokens=3)
    acc.put_back(taken)
    usage.write_batch(acc.take())
    row = UsageMinute.objects.get()
    assert (row.requests, row.prompt_tokens) == (2, 5)


def test_rows_of_a_deleted_key_are_dropped(operator, now):
    key, _ = keys.create_key(name="k", owner=operator, now=now)
    acc = usage.Accumulator()
    acc.add(key.id, "demo", now.timestamp())
    acc.add(key.id + 1000, "demo", now.timestamp())
    assert usage.write_batch(acc.take()) == 1


def test_spent_this_day_and_month_in_one_query(operator, now, django_assert_num_queries):
    a, _ = keys.create_key(name="a", owner=operator, now=now - dt.timedelta(days=60))
    b, _ = keys.create_key(name="b", owner=operator, now=now - dt.timedelta(days=60))
    c, _ = keys.create_key(name="c", owner=operator, now=now - dt.timedelta(days=60))
    acc = usage.Accumulator()
    t = now.timestamp()  # 2026-11-30 12:00 UTC
    acc.add(a.id, "demo", t, prompt_tokens=3, completion_tokens=4)
    acc.add(a.id, "other", t - 12 * 3600, prompt_tokens=1)  # 00:00 today: today
    acc.add(a.id, "demo", t - 12 * 3600 - 1, prompt_tokens=10)  # 23:59 yesterday: this month only
    acc.add(a.id, "demo", t - 30 * 86400, prompt_tokens=100)  # October: neither
    acc.add(b.id, "demo", t - 86400, completion_tokens=5)
    usage.write_batch(acc.take())
    with django_assert_num_queries(1):
        got = usage.spent([a.id, b.id, c.id], now)
    assert got == {a.id: usage.Spent(day=8, month=18), b.id: usage.Spent(day=0, month=5)}
    assert usage.spent([], now) == {}


def test_daily_tokens_fill_days_without_use(operator, now):
    key, _ = keys.create_key(name="a", owner=operator, now=now - dt.timedelta(days=60))
    acc = usage.Accumulator()
    t = now.timestamp()
    acc.add(key.id, "demo", t, prompt_tokens=3, completion_tokens=4)
    acc.add(key.id, "x", t - 2 * 86400, prompt_tokens=5)
    acc.add(key.id, "x", t - 3 * 86400, prompt_tokens=500)  # before the window of 3 days
    usage.write_batch(acc.take())
    assert usage.daily_tokens(key.id, now, days=3) == [
        (dt.date(2026, 11, 28), 5),
        (dt.date(2026, 11, 29), 0),
        (dt.date(2026, 11, 30), 7),
    ]
