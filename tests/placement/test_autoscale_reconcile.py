"""The autoscaler inside the reconciler: signals from every gateway, steps as events, which replica goes."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from inventory.heartbeat import touch
from inventory.models import Command
from placement import demand, inflight
from placement.models import AutoscaleSample, Deployment, EngineProfile, PlacementEvent, Replica
from placement.reconciler import reconcile
from tests.factories import make_node, report_shard_state
from tests.inventory.test_metrics import scrape

pytestmark = pytest.mark.django_db

GATEWAYS = ("gw1", "gw2")


def report(process: str, counts: dict[str, int] | None = None, models: dict[str, demand.ModelDemand] | None = None):
    """What a gateway process writes every half second: in-flight per replica, demand per model."""

    async def go():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            await inflight.report_async(client, process, counts)
            await demand.report_async(client, process, models)
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.fixture(autouse=True)
def _no_gateways():
    for p in GATEWAYS:
        report(p)
    yield
    for p in GATEWAYS:
        report(p)


def later(now: dt.datetime, s: float) -> dt.datetime:
    return now + dt.timedelta(seconds=s)


def ready_all(now) -> None:
    for rep in Replica.objects.filter(state="starting"):
        for s in rep.shards.all():
            report_shard_state(s.id, "ready", now=now)
    reconcile(now=now)


def autoscaled(name="chat", **policy) -> Deployment:
    profile, _ = EngineProfile.objects.get_or_create(name="echo-1", engine="echo", gpus_per_node=1)
    fields = {"autoscale_metric": "inflight", "autoscale_min": 1, "autoscale_max": 4, "autoscale_target": 2.0}
    return Deployment.objects.create(
        name=name, served_model=name, profile=profile, replicas=1, **{**fields, "scale_down_window_s": 60, **policy}
    )


def live(dep) -> list[Replica]:
    return list(Replica.objects.filter(deployment=dep).exclude(state__in=["stopped", "failed"]))


def test_scale_up_from_the_in_flight_of_every_gateway(now, client):
    make_node("a", now=now)
    dep = autoscaled()
    reconcile(now=now)
    ready_all(now)
    (rep,) = live(dep)
    report("gw1", {str(rep.id): 3})
    report("gw2", {str(rep.id): 3})
    report_ = reconcile(now=later(now, 10))
    dep.refresh_from_db()
    assert dep.replicas == 3
    assert report_.autoscaled == [f"{dep.id}: 6.0 requests in flight per replica > 2: 1 -> 3 replicas"]
    ev = PlacementEvent.objects.get(kind="autoscaled")
    assert (ev.deployment_id, ev.actor_name) == (dep.id, "system")
    # Placed by the planner like any replica, in the same pass.
    assert sorted(r.state for r in live(dep)) == ["ready", "starting", "starting"]
    assert Command.objects.filter(kind="start_shard").count() == 3
    s = AutoscaleSample.objects.filter(deployment=dep).order_by("at").last()
    assert (s.replicas, s.desired, s.recommended, s.signal, s.inflight) == (1, 3, 3, 6.0, 6)
    # The autoscaler's view on the control plane's /metrics.
    m = scrape(client)
    name = (("deployment", "chat"),)
    assert m["llmgw_autoscale_desired_replicas"] == {name: 3.0}
    assert m["llmgw_autoscale_recommended_replicas"] == {name: 3.0}
    assert m["llmgw_autoscale_signal"] == {(("deployment", "chat"), ("metric", "inflight")): 6.0}
    assert m["llmgw_autoscale_held_requests"] == {name: 0.0}
    assert m["llmgw_autoscale_steps_total"] == {name: 1.0}
    # While the new ones start, the same load adds none.
    reconcile(now=later(now, 20))
    dep.refresh_from_db()
    assert dep.replicas == 3 and len(live(dep)) == 3


def test_scale_down_retires_the_replica_with_fewest_requests_then_on_the_emptiest_node(now):
    make_node("a", now=now, gpus=2)
    make_node("b", now=now, gpus=8)
    dep = autoscaled(autoscale_min=1, autoscale_max=3, policy="spread")
    Deployment.objects.filter(id=dep.id).update(replicas=3)
    reconcile(now=now)
    ready_all(now)
    reps = live(dep)
    assert len(reps) == 3
    on = {r.id: r.shards.get().node_id for r in reps}
    busy = next(r for r in reps if on[r.id] == "b")
    counts = {str(busy.id): 1}
    for t in (0, 30, 61):
        report("gw1", counts)
        reconcile(now=later(now, 10 + t))
    dep.refresh_from_db()
    # 1 in flight over 3 replicas: one replica is enough; the two idle ones go, the busy one stays.
    assert dep.replicas == 1
    draining = {r.id for r in Replica.objects.filter(deployment=dep, state="draining")}
    assert busy.id not in draining and len(draining) == 2
    ev = PlacementEvent.objects.filter(kind="autoscaled").first()
    assert ev.reason == "0.3 requests in flight per replica < 2 for 71 s: 3 -> 1 replicas"


def test_of_two_idle_replicas_the_one_on_the_emptier_node_goes(now):
    make_node("a", now=now, labels={"slot": "a"})
    make_node("b", now=now, labels={"slot": "b"})
    dep = autoscaled(autoscale_max=2, policy="spread")
    Deployment.objects.filter(id=dep.id).update(replicas=2)
    reconcile(now=now)
    assert sorted(r.shards.get().node_id for r in live(dep)) == ["a", "b"]
    profile = EngineProfile.objects.get(name="echo-1")
    Deployment.objects.create(
        name="other", served_model="other", profile=profile, replicas=5, node_selector={"slot": "a"}
    )
    reconcile(now=now)
    ready_all(now)
    # Node a: 2 of 8 cards free; node b: 7. The replica on b goes: b's cards come back whole.
    on_b = next(r for r in live(dep) if r.shards.get().node_id == "b")
    report("gw1", {str(r.id): 1 for r in live(dep)})
    for t in (0, 30, 61):
        reconcile(now=later(now, 10 + t))
    assert [r.id for r in Replica.objects.filter(deployment=dep, state="draining")] == [on_b.id]


def test_idle_goes_to_zero_drained_and_a_held_request_brings_one_back(now):
    make_node("a", now=now)
    dep = autoscaled(autoscale_min=0, scale_down_window_s=60)
    reconcile(now=now)
    ready_all(now)
    for t in (10, 40, 71):
        reconcile(now=later(now, t))
    dep.refresh_from_db()
    assert dep.replicas == 0
    (rep,) = live(dep)
    assert rep.state == "draining"
    assert PlacementEvent.objects.filter(kind="autoscaled").first().reason == "no requests for 71 s: 1 -> 0 replicas"
    # Drained as any scale-down: told to stop once no gateway routes to it, released once stopped.
    reconcile(now=later(now, 200))
    for s in rep.shards.all():
        report_shard_state(s.id, "stopped", now=later(now, 201))
    reconcile(now=later(now, 202))
    assert live(dep) == []
    # A gateway holds a request for the model: one replica is placed at once.
    report("gw2", models={"chat": demand.ModelDemand(held=1)})
    touch("a", now=later(now, 210))
    reconcile(now=later(now, 210))
    dep.refresh_from_db()
    assert dep.replicas == 1
    assert [(r.state, r.reason) for r in live(dep)] == [("starting", "placed on a")]
    assert (
        PlacementEvent.objects.filter(kind="autoscaled").first().reason
        == "1 requests waiting at zero replicas: 0 -> 1 replicas"
    )


def test_a_scale_up_no_node_can_take_says_why_and_does_not_loop(now):
    dep = autoscaled(autoscale_min=0, autoscale_max=4)
    Deployment.objects.filter(id=dep.id).update(replicas=0)
    report("gw1", models={"chat": demand.ModelDemand(held=5)})
    for t in (0, 10, 20, 30):
        reconcile(now=later(now, t))
    dep.refresh_from_db()
    # 5 held over a target of 2 per replica: 3 at once, then nothing more while they wait.
    assert dep.replicas == 3
    reps = live(dep)
    assert [r.state for r in reps] == ["pending"] * 3
    assert {r.reason for r in reps} == {"no nodes"}
    assert PlacementEvent.objects.filter(kind="autoscaled").count() == 1
    assert Replica.objects.filter(deployment=dep).count() == 3


def test_signals_of_a_gateway_that_stopped_reporting_do_not_count(now):
    make_node("a", now=now)
    dep = autoscaled()
    reconcile(now=now)
    ready_all(now)
    (rep,) = live(dep)
    report("gw1", {str(rep.id): 8})
    report("gw1")  # withdrawn: the process stopped
    reconcile(now=later(now, 10))
    dep.refresh_from_db()
    assert dep.replicas == 1


def test_demand_totals_merge_every_gateway():
    report("gw1", models={"m": demand.ModelDemand(held=2, ttft=(0.1, 0.2), waiting=3.0)})
    report("gw2", models={"m": demand.ModelDemand(held=1, ttft=tuple(0.1 * i for i in range(1, 19)), waiting=5.0)})
    t = demand.totals()
    assert t.routers == 2
    assert (t.held("m"), t.waiting("m")) == (3, 5.0)
    assert t.ttft_p95("m") == pytest.approx(1.7)
    assert (t.held("other"), t.waiting("other"), t.ttft_p95("other")) == (0, None, None)


def test_paused_and_fixed_deployments_are_left_alone(now):
    make_node("a", now=now)
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    fixed = Deployment.objects.create(name="fixed", served_model="fixed", profile=profile, replicas=2)
    paused = autoscaled(name="paused", paused=True, autoscale_min=3)
    reconcile(now=now)
    fixed.refresh_from_db()
    paused.refresh_from_db()
    assert (fixed.replicas, paused.replicas) == (2, 1)
    assert not AutoscaleSample.objects.exists()


def test_ttft_p95_over_every_gateway_scales_up_after_the_window(now):
    make_node("a", now=now)
    dep = autoscaled(autoscale_metric="ttft_p95", autoscale_target=1.0, scale_up_window_s=20)
    reconcile(now=now)
    ready_all(now)
    (rep,) = live(dep)
    # One gateway saw fast first tokens, the other slow ones: the p95 is over both (nearest rank of 20).
    counts = []
    for t in (10, 20, 30):
        report("gw1", {str(rep.id): 2}, {"chat": demand.ModelDemand(ttft=(0.2,) * 10)})
        report("gw2", {str(rep.id): 2}, {"chat": demand.ModelDemand(ttft=(2.5,) * 10)})
        reconcile(now=later(now, t))
        dep.refresh_from_db()
        counts.append(dep.replicas)
    # Slow since 10 s: the 20 s window is covered at 30 s.
    assert counts == [1, 1, 3]
    ev = PlacementEvent.objects.get(kind="autoscaled")
    assert ev.reason == "TTFT p95 2.5 s > 1.0 s for 20 s: 1 -> 3 replicas"


def test_the_engines_queue_scales_up(now):
    make_node("a", now=now)
    dep = autoscaled(autoscale_metric="queue", autoscale_target=2.0)
    reconcile(now=now)
    ready_all(now)
    (rep,) = live(dep)
    # Both gateways scrape the same engine: its queue counts once (the highest), not twice.
    report("gw1", {str(rep.id): 4}, {"chat": demand.ModelDemand(waiting=6.0)})
    report("gw2", {str(rep.id): 4}, {"chat": demand.ModelDemand(waiting=5.0)})
    reconcile(now=later(now, 10))
    dep.refresh_from_db()
    assert dep.replicas == 3
    assert PlacementEvent.objects.get(kind="autoscaled").reason == (
        "6.0 requests waiting per replica > 2: 1 -> 3 replicas"
    )


def test_samples_older_than_a_day_are_pruned(now):
    dep = autoscaled()
    old = AutoscaleSample.objects.create(deployment=dep, at=later(now, -86_401), replicas=1, desired=1, recommended=1)
    kept_one = AutoscaleSample.objects.create(
        deployment=dep, at=later(now, -86_000), replicas=1, desired=1, recommended=1
    )
    reconcile(now=now)
    left = set(AutoscaleSample.objects.filter(deployment=dep).values_list("id", flat=True))
    assert old.id not in left and kept_one.id in left and len(left) == 2
