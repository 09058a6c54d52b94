"""Retiring a serving replica: routers stop choosing it, its shards stop when its requests are done."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from inventory.models import Command
from placement import inflight
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica
from placement.reconciler import reconcile
from tests.factories import make_node, report_shard_state

pytestmark = pytest.mark.django_db

SETTLE = 5.0 + 2 * inflight.REPORT_TTL_S  # LLMGW_GATEWAY_REFRESH + two report lifetimes


def report(process: str, counts: dict[str, int] | None) -> None:
    """What a gateway process writes every half second."""

    async def go():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            await inflight.report_async(client, process, counts)
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.fixture(autouse=True)
def _no_routers(settings):
    settings.LLMGW_GATEWAY_REFRESH = 5.0
    for p in ("gw1", "gw2"):
        report(p, None)
    yield
    for p in ("gw1", "gw2"):
        report(p, None)


@pytest.fixture
def serving(now) -> tuple[Deployment, Replica]:
    make_node("a", now=now)
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=1)
    reconcile(now=now)
    rep = Replica.objects.get(deployment=dep)
    for s in rep.shards.all():
        report_shard_state(s.id, "ready", now=now)
    reconcile(now=now)
    rep.refresh_from_db()
    assert rep.state == "ready"
    return dep, rep


def _stops() -> int:
    return Command.objects.filter(kind="stop_shard").count()


def test_totals_sum_live_routers():
    assert inflight.totals() == inflight.Totals(0, {})
    report("gw1", {"r1": 2, "r2": 1})
    report("gw2", {"r1": 3})
    assert inflight.totals() == inflight.Totals(2, {"r1": 5, "r2": 1})
    report("gw2", {})
    assert inflight.totals() == inflight.Totals(2, {"r1": 2, "r2": 1})
    report("gw1", None)
    assert inflight.totals() == inflight.Totals(1, {})


def test_scale_down_waits_for_requests_in_flight(now, serving):
    dep, rep = serving
    report("gw1", {str(rep.id): 2})
    dep.replicas = 0
    dep.save()
    reconcile(now=now)
    rep.refresh_from_db()
    assert (rep.state, rep.stop_requested_at, _stops()) == ("draining", None, 0)
    # Settled, but two requests still run there.
    reconcile(now=now + dt.timedelta(seconds=SETTLE + 1))
    assert _stops() == 0
    report("gw1", {})
    # Idle, but a router may not have seen the retirement yet.
    reconcile(now=now + dt.timedelta(seconds=SETTLE - 1))
    assert _stops() == 0
    reconcile(now=now + dt.timedelta(seconds=SETTLE + 2))
    rep.refresh_from_db()
    assert _stops() == 1
    assert rep.stop_requested_at == now + dt.timedelta(seconds=SETTLE + 2)
    ev = PlacementEvent.objects.filter(replica=rep, kind="stopping").get()
    assert ev.reason == "no requests in flight"
    reconcile(now=now + dt.timedelta(seconds=SETTLE + 3))
    assert _stops() == 1  # told once


def test_requests_that_never_end_are_cut_after_the_timeout(now, serving, settings):
    settings.LLMGW_DRAIN_REQUESTS_TIMEOUT = 120.0
    dep, rep = serving
    report("gw1", {str(rep.id): 1})
    report("gw2", {str(rep.id): 1})
    dep.replicas = 0
    dep.save()
    reconcile(now=now)
    reconcile(now=now + dt.timedelta(seconds=119))
    assert _stops() == 0
    reconcile(now=now + dt.timedelta(seconds=121))
    assert _stops() == 1
    ev = PlacementEvent.objects.get(replica=rep, kind="stopping")
    assert ev.reason == "2 requests still in flight after 121 s"
    # The shards' own stop timeout counts from the stop, not from the drain.
    reconcile(now=now + dt.timedelta(seconds=121 + 89))
    rep.refresh_from_db()
    assert rep.state == "draining"
    reconcile(now=now + dt.timedelta(seconds=121 + 91))
    rep.refresh_from_db()
    assert rep.state == "stopped"


def test_no_router_alive_stops_at_once(now, serving):
    dep, rep = serving
    dep.replicas = 0
    dep.save()
    reconcile(now=now)
    rep.refresh_from_db()
    assert (rep.state, rep.stop_requested_at, _stops()) == ("draining", now, 1)


def test_redis_gone_the_totals_say_unknown(redis_gone):
    assert inflight.totals() == inflight.Totals(0, {}, known=False)


def test_redis_gone_a_retiring_replica_waits_out_the_drain_timeout_and_the_pass_goes_on(
    now, serving, redis_gone, settings
):
    """A scale-down and a scale-up in one pass: the retiring replica waits, the new one is placed meanwhile."""
    settings.LLMGW_DRAIN_REQUESTS_TIMEOUT = 120.0
    dep, rep = serving
    other = Deployment.objects.create(name="other", served_model="other", profile=dep.profile, replicas=1)
    dep.replicas = 0
    dep.save()
    report_ = reconcile(now=now)
    rep.refresh_from_db()
    assert (rep.state, rep.stop_requested_at, _stops()) == ("draining", None, 0)
    assert report_.placed == 1 and Replica.objects.filter(deployment=other).count() == 1
    # Settled, idle as far as anyone knows: nobody knows, so the stop waits for the timeout.
    reconcile(now=now + dt.timedelta(seconds=SETTLE + 1))
    reconcile(now=now + dt.timedelta(seconds=119))
    assert _stops() == 0
    reconcile(now=now + dt.timedelta(seconds=121))
    assert _stops() == 1
    ev = PlacementEvent.objects.get(replica=rep, kind="stopping")
    assert ev.reason == "in-flight requests unknown (reports unreadable) after 121 s"
