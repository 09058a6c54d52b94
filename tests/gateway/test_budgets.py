"""Token budgets per UTC day and month: counted in Redis (or memory), checked against the recorded spend."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid

import httpx
import pytest
import redis.asyncio as aioredis
from django.conf import settings
from django.utils import timezone

from gateway import keys, notify, usage
from gateway.dataplane.budgets import EXPIRY_MARGIN_S, Budgets, period_ends
from gateway.dataplane.limits import Shared
from gateway.table import KeyEntry
from tests.gateway.conftest import chat, make_deployment, make_key, url_of, wait_for

# 2026-11-30 22:00:00 UTC: two hours before the day ends, a day before the month does.
T = dt.datetime(2026, 11, 30, 22, 0, tzinfo=dt.UTC).timestamp()


def entry(**kw) -> KeyEntry:
    base = {"id": 7, "name": "team", "expires_at": None, "allowed_models": None, "rpm_limit": 0, "tpm_limit": 0}
    return KeyEntry(**{**base, **kw})


def error(refusal) -> dict:
    return json.loads(refusal.body)["error"]


@pytest.fixture
def shared():
    """Two data planes' budget counters on one Redis (a fresh prefix), as two gateway processes have them."""

    async def make(prefix: str) -> tuple[Budgets, Budgets, aioredis.Redis]:
        r = aioredis.Redis.from_url(settings.REDIS_URL)
        return Budgets(Shared(r), prefix), Budgets(Shared(r), prefix), r

    return make


def test_period_ends():
    assert period_ends(T) == (
        int(T // 86400),
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp(),
        2026 * 12 + 10,
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp(),
    )
    dec = dt.datetime(2026, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()
    assert period_ends(dec)[3] == dt.datetime(2027, 1, 1, tzinfo=dt.UTC).timestamp()


def test_a_key_without_budgets_is_never_counted():
    async def go():
        b = Budgets(Shared(None), "x")
        key = entry()
        await b.spend(key, 10**9, T)
        assert b.local == {}
        assert await b.admit(key, T) is None

    asyncio.run(go())


def test_a_day_budget_spent_across_two_processes_refuses_until_midnight(shared):
    prefix = f"llmgw-budget-test-{uuid.uuid4().hex[:8]}"

    async def go():
        a, b, r = await shared(prefix)
        key = entry(tokens_per_day=10)
        try:
            assert await a.admit(key, T) is None
            await a.spend(key, 6, T)
            # The other process sees it: 6 of 10, still admitted; the request that crosses finishes.
            assert await b.admit(key, T + 1) is None
            await b.spend(key, 6, T + 1)
            refused = await a.admit(key, T + 2)
            assert refused is not None
            assert error(refused) == {
                "message": "API key 'team' has used its budget of 10 tokens for this UTC day (12 spent);"
                " it resets at 2026-12-01T00:00:00Z",
                "type": "insufficient_quota",
                "param": None,
                "code": "insufficient_quota",
            }
            assert refused.headers == [(b"retry-after", b"7198")]
            assert refused.resets_at == dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()
            # The counters go when their period has: an hour after its end.
            day_key = f"{prefix}:gw:budget:day:7:{int(T // 86400)}"
            assert 7198 + EXPIRY_MARGIN_S <= await r.ttl(day_key) <= 7200 + EXPIRY_MARGIN_S
            # A new UTC day starts from nothing.
            assert await b.admit(key, T + 2 * 3600) is None
        finally:
            leftover = [k async for k in r.scan_iter(f"{prefix}:*")]
            if leftover:
                await r.delete(*leftover)
            await r.aclose()

    asyncio.run(go())


def test_the_month_refuses_with_its_own_later_reset():
    async def go():
        b = Budgets(Shared(None), "x")
        key = entry(tokens_per_day=50, tokens_per_month=100)
        await b.spend(key, 60, T - 86400)  # yesterday
        await b.spend(key, 50, T)  # today: day and month both spent
        refused = await b.admit(key, T)
        assert error(refused)["message"] == (
            "API key 'team' has used its budget of 100 tokens for this UTC month (110 spent);"
            " it resets at 2026-12-01T00:00:00Z"
        )
        # On 1 December both have reset.
        assert await b.admit(key, T + 3 * 3600) is None
        key = entry(tokens_per_day=50, tokens_per_month=1000)
        refused = await Budgets(Shared(None), "x", dict(b.local)).admit(key, T)
        assert "for this UTC day (50 spent)" in error(refused)["message"]

    asyncio.run(go())


def test_the_recorded_spend_counts_when_the_counters_lost_it():
    today = dt.datetime.fromtimestamp(T, tz=dt.UTC).date()

    async def go():
        b = Budgets(Shared(None), "x")  # a process that has counted nothing (Redis restarted, or none)
        seen = usage.Spent(day=10, month=40)
        refused = await b.admit(entry(tokens_per_day=10, recorded=seen, recorded_on=today), T)
        assert "for this UTC day (10 spent)" in error(refused)["message"]
        refused = await b.admit(entry(tokens_per_month=40, recorded=seen, recorded_on=today), T)
        assert "for this UTC month (40 spent)" in error(refused)["message"]
        # Read yesterday: its day says nothing of today's, its month still counts.
        yesterday = today - dt.timedelta(days=1)
        assert await b.admit(entry(tokens_per_day=10, recorded=seen, recorded_on=yesterday), T) is None
        refused = await b.admit(entry(tokens_per_month=40, recorded=seen, recorded_on=yesterday), T)
        assert refused is not None
        # Read last month: nothing of it counts.
        october = dt.date(2026, 10, 31)
        assert await b.admit(entry(tokens_per_month=40, recorded=seen, recorded_on=october), T) is None
        # The larger of the two is judged: counted past what was recorded.
        await b.spend(entry(tokens_per_day=100), 30, T)
        refused = await b.admit(entry(tokens_per_day=25, recorded=seen, recorded_on=today), T)
        assert "(30 spent)" in error(refused)["message"]

    asyncio.run(go())


def _next_midnight() -> dt.datetime:
    return usage.day_start(dt.datetime.now(dt.UTC)) + dt.timedelta(days=1)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_spent_day_budget_is_a_429_with_the_reset_across_gateways(gateway_factory, echoes, user):
    first, second = gateway_factory("budget-a"), gateway_factory("budget-b")
    make_deployment("demo", [url_of(echoes())])
    secret = make_key(user, name="budgeted", tokens_per_day=10)
    for g in (first, second):
        g.wait_ready(secret, "demo", 1)
    # Within one UTC day (the counters are the day's).
    wait_for(lambda: dt.datetime.now(dt.UTC).hour < 23 or dt.datetime.now(dt.UTC).minute < 59, timeout=70)
    with first.client(secret) as c1, second.client(secret) as c2:
        # 3 prompt + 3 completion tokens each: 6 of 10 after the first, 12 after the second.
        assert c1.post("/v1/completions", json={"model": "demo", "prompt": "a b c"}).status_code == 200
        assert c2.post("/v1/completions", json={"model": "demo", "prompt": "a b c"}).status_code == 200
        r = c1.post("/v1/chat/completions", json=chat("hello"))
    assert r.status_code == 429
    reset = _next_midnight()
    assert r.json() == {
        "error": {
            "message": f"API key 'budgeted' has used its budget of 10 tokens for this UTC day (12 spent);"
            f" it resets at {reset:%Y-%m-%dT%H:%M:%SZ}",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
    left = (reset - dt.datetime.now(dt.UTC)).total_seconds()
    assert left - 5 <= int(r.headers["retry-after"]) <= left + 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_recorded_spend_refuses_a_key_its_counters_never_saw(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    plenty = make_key(user, name="plenty")
    gateway.wait_ready(plenty, "demo", 1)
    key, secret = keys.create_key(name="spent-elsewhere", owner=user, now=timezone.now(), tokens_per_month=100)
    # Spent before these counters existed (another install's Redis, lost at a restart): only the rows know.
    acc = usage.Accumulator()
    acc.add(key.id, "demo", time.time(), prompt_tokens=60, completion_tokens=40)
    usage.write_batch(acc.take())
    notify.publish("keys")

    def refused() -> httpx.Response | None:
        with gateway.client(secret) as c:
            r = c.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        return r if r.status_code == 429 else None

    r = wait_for(refused, timeout=10, what="a 429 for the key whose month is spent in the database")
    assert r.json()["error"]["code"] == "insufficient_quota"
    assert "for this UTC month (100 spent)" in r.json()["error"]["message"]
    with gateway.client(plenty) as c:
        assert c.post("/v1/completions", json={"model": "demo", "prompt": "a"}).status_code == 200
