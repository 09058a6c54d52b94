"""The reconciler, called directly with `now`; shard states written the way a heartbeat would."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from django.db import IntegrityError, connection, transaction

import llmgw_wire as wire
from inventory import allocation, outbox
from inventory.heartbeat import touch
from inventory.models import AllocatedGPU, Allocation, Command, NodeEvent
from inventory.nodes import change_state as node_state
from llmgw import locks
from llmgw_wire import shard_states
from placement import agent_sync
from placement.backoff import start_failures
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from placement.reconciler import create_replicas, reconcile, release_orphans
from placement.tasks import LOCK_NAME, reconcile_task
from tests.factories import make_node, other_session

pytestmark = pytest.mark.django_db


@pytest.fixture
def profile():
    return EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4, memory_gb=16)


def deploy(profile, name="chat", replicas=1, **kw) -> Deployment:
    return Deployment.objects.create(name=name, served_model=name, profile=profile, replicas=replicas, **kw)


def states(dep) -> list[str]:
    return sorted(Replica.objects.filter(deployment=dep).values_list("state", flat=True))


def report_state(shard: Shard, state: str, *, now, reason: str = "") -> None:
    """A heartbeat from the shard's node reporting it in `state`: the path production runs."""
    status = wire.ShardStatus(shard_id=str(shard.id), replica_id=str(shard.replica_id), state=state, reason=reason)
    agent_sync.record_shard_states(shard.node_id, [status], now=now)


def all_ready(now, **filters) -> None:
    """What heartbeats would report once the engines are up."""
    for s in Shard.objects.filter(**filters).exclude(state__in=["ready", *shard_states.TERMINAL]):
        report_state(s, "ready", now=now, reason="health check passed")


def stopped(now, **filters) -> None:
    """What heartbeats report once the agents have stopped what they were told to."""
    for s in Shard.objects.filter(replica__state="draining", **filters).exclude(state__in=shard_states.TERMINAL):
        report_state(s, "stopped", now=now, reason="stop requested")


def commands(kind, node_id=None):
    qs = Command.objects.filter(kind=kind)
    if node_id:
        qs = qs.filter(node_id=node_id)
    return list(qs.order_by("created_at", "id"))


def test_scale_up_places_and_queues_start_shard(now, profile):
    make_node("a", now=now, mgmt_addr="10.0.0.1")
    dep = deploy(profile, replicas=2, pool="blue")
    report = reconcile(now=now)
    assert (report.created, report.placed, report.pending) == (2, 2, 0)
    assert states(dep) == ["starting", "starting"]
    shards = list(Shard.objects.order_by("http_port"))
    assert [(s.node_id, s.gpu_indices, s.http_port, s.state) for s in shards] == [
        ("a", [0, 1, 2, 3], 18000, "pending"),
        ("a", [4, 5, 6, 7], 18001, "pending"),
    ]
    assert sorted(AllocatedGPU.objects.values_list("gpu_index", flat=True)) == list(range(8))
    assert list(Allocation.objects.values_list("memory_gb", flat=True)) == [16, 16]
    starts = commands("start_shard", "a")
    assert len(starts) == 2
    p = starts[0].payload
    assert (p["leader_addr"], p["nnodes"], p["pool"], p["profile_fp"]) == ("10.0.0.1", 1, "blue", profile.fingerprint())
    assert p["profile"]["served_model_name"] == "chat"
    assert p["startup_timeout_s"] == 1800.0
    rep = Replica.objects.get(shards__http_port=18000)
    assert rep.endpoint == "http://10.0.0.1:18000"
    assert rep.reason == "placed on a"


def test_ready_when_all_shards_ready_and_idempotent(now, profile):
    make_node("a", now=now)
    dep = deploy(profile)
    reconcile(now=now)
    all_ready(now)
    report = reconcile(now=now + dt.timedelta(seconds=10))
    assert report.ready == 1
    rep = Replica.objects.get(deployment=dep)
    assert (rep.state, rep.ready_at) == ("ready", now + dt.timedelta(seconds=10))
    before = (Command.objects.count(), PlacementEvent.objects.count(), Allocation.objects.count())
    again = reconcile(now=now + dt.timedelta(seconds=20))
    assert (again.created, again.placed, again.ready, again.stopped, again.failed) == (0, 0, 0, 0, 0)
    assert (Command.objects.count(), PlacementEvent.objects.count(), Allocation.objects.count()) == before


def test_degraded_then_ready_again(now, profile):
    make_node("a", now=now)
    dep = deploy(profile)
    reconcile(now=now)
    all_ready(now)
    reconcile(now=now)
    shard = Shard.objects.get()
    report_state(shard, "loading", now=now, reason="engine restarting")
    reconcile(now=now)
    rep = Replica.objects.get(deployment=dep)
    assert (rep.state, rep.reason) == ("degraded", "shard 0 on a loading")
    all_ready(now)
    reconcile(now=now)
    assert states(dep) == ["ready"]


def test_failed_shard_releases_the_replica_whole_and_places_again(now, profile):
    make_node("a", now=now)
    make_node("b", now=now)
    dep = deploy(profile.__class__.objects.create(name="two", engine="echo", gpus_per_node=8), replicas=1)
    reconcile(now=now)
    all_ready(now)
    reconcile(now=now)
    old = Replica.objects.get(deployment=dep)
    old_shard = old.shards.get()
    report_state(old_shard, "failed", now=now, reason="exit 137")
    report = reconcile(now=now + dt.timedelta(seconds=5))
    assert (report.failed, report.created, report.placed) == (1, 1, 1)
    old.refresh_from_db()
    assert (old.state, old.reason) == ("failed", f"shard 0 on {old_shard.node_id} failed: exit 137")
    assert not Allocation.objects.filter(replica_id=old.id).exists()
    assert old_shard.node_id == "a"
    assert [c.payload["shard_id"] for c in commands("stop_shard")] == []  # the failed shard has nothing to stop
    new = Replica.objects.get(deployment=dep, state="starting")
    # Released whole: node a's cards are free again, and binpack (ties by id) takes it first.
    assert new.shards.get().node_id == "a"


def ready_on_one_of_two_nodes(now) -> tuple[Deployment, Replica]:
    """A deployment of one whole-node replica, ready on one of two nodes."""
    prof = EngineProfile.objects.create(name="full", engine="echo", gpus_per_node=8)
    make_node("a", now=now)
    make_node("b", now=now)
    dep = deploy(prof)
    reconcile(now=now)
    all_ready(now)
    reconcile(now=now)
    return dep, Replica.objects.get(deployment=dep)


def test_lost_node_fails_the_replica_and_it_comes_back_elsewhere(now):
    dep, first = ready_on_one_of_two_nodes(now)
    lost = first.shards.get().node_id
    node_state(lost, "unreachable", now=now)
    node_state(lost, "lost", now=now)
    # The other node kept heartbeating: its lease holds.
    touch(({"a", "b"} - {lost}).pop(), now=now + dt.timedelta(minutes=5))
    reconcile(now=now + dt.timedelta(minutes=5))
    first.refresh_from_db()
    assert (first.state, first.reason) == ("failed", f"node {lost} lost")
    stops = commands("stop_shard", lost)
    assert [c.payload["shard_id"] for c in stops] == [str(first.shards.get().id)]
    again = Replica.objects.get(deployment=dep, state="starting")
    assert again.shards.get().node_id == ({"a", "b"} - {lost}).pop()


def test_drain_starts_the_new_replica_before_stopping_the_old(now):
    dep, old = ready_on_one_of_two_nodes(now)
    node_id = old.shards.get().node_id
    node_state(node_id, "draining", now=now, reason="maintenance")
    reconcile(now=now)
    assert states(dep) == ["ready", "starting"]
    new = Replica.objects.get(deployment=dep, state="starting")
    assert new.replaces_id == old.id
    assert not commands("stop_shard")
    reconcile(now=now)  # the new one is not ready yet: nothing changes
    assert states(dep) == ["ready", "starting"]
    all_ready(now, replica=new)
    report = reconcile(now=now + dt.timedelta(seconds=30))
    # The old one stops only now, and keeps its GPUs until its process has ended.
    assert states(dep) == ["draining", "ready"]
    assert [c.node_id for c in commands("stop_shard")] == [node_id]
    assert report.drained == []
    assert Allocation.objects.filter(replica_id=old.id).count() == 1
    stopped(now)
    report = reconcile(now=now + dt.timedelta(seconds=35))
    assert states(dep) == ["ready", "stopped"]
    old.refresh_from_db()
    assert (old.state, old.reason) == ("stopped", f"replaced by {new.id}")
    assert not Allocation.objects.filter(replica_id=old.id).exists()
    assert report.drained == [node_id]
    drained = NodeEvent.objects.filter(node_id=node_id, kind="drained")
    assert [e.message for e in drained] == ["no replicas left; uncordon to use it again"]
    reconcile(now=now + dt.timedelta(seconds=40))
    assert NodeEvent.objects.filter(node_id=node_id, kind="drained").count() == 1


def test_profile_change_rolls_one_replica_at_a_time(now, profile):
    make_node("a", now=now, gpus=16)
    dep = deploy(profile, replicas=2)
    reconcile(now=now)
    all_ready(now)
    reconcile(now=now)
    profile.args = ["--new-flag"]
    profile.save()
    reconcile(now=now)
    assert states(dep) == ["ready", "ready", "starting"]
    reconcile(now=now)
    assert states(dep) == ["ready", "ready", "starting"]
    all_ready(now)
    reconcile(now=now)  # first old one stopping, second roll begins
    assert states(dep) == ["draining", "ready", "ready", "starting"]
    stopped(now)
    all_ready(now)
    reconcile(now=now)
    assert states(dep) == ["draining", "ready", "ready", "stopped"]
    stopped(now)
    reconcile(now=now)
    assert states(dep) == ["ready", "ready", "stopped", "stopped"]
    fps = set(Replica.objects.filter(deployment=dep, state="ready").values_list("profile_fp", flat=True))
    assert fps == {profile.fingerprint()}


def test_scale_down_stops_the_least_useful_first(now, profile):
    make_node("a", now=now, gpus=12)
    dep = deploy(profile, replicas=3)
    reconcile(now=now)
    ready_one = Replica.objects.filter(deployment=dep).order_by("created_at", "id").first()
    all_ready(now, replica=ready_one)
    reconcile(now=now)
    # A heartbeat's answer carried the StartShards: the engines may be starting.
    outbox.pending("a", now=now)
    dep.replicas = 1
    dep.save()
    report = reconcile(now=now)
    assert report.stopped == 2
    # The two that were starting drain; nothing was ever ready there to lose.
    assert states(dep) == ["draining", "draining", "ready"]
    assert len(commands("stop_shard")) == 2
    assert Allocation.objects.count() == 3
    # One reports stopped; the other's agent never answers and is released after the timeout.
    stopped(now, replica_id=Replica.objects.filter(state="draining").order_by("id").first().id)
    reconcile(now=now + dt.timedelta(seconds=1))
    assert states(dep) == ["draining", "ready", "stopped"]
    reconcile(now=now + dt.timedelta(seconds=91))
    assert states(dep) == ["ready", "stopped", "stopped"]
    assert Allocation.objects.count() == 1
    late = PlacementEvent.objects.filter(to_state="stopped").order_by("at").last()
    assert late.reason == "scaled down"


def test_paused_deployments_are_left_alone(now, profile):
    make_node("a", now=now)
    dep = deploy(profile, paused=True)
    assert reconcile(now=now).created == 0
    assert states(dep) == []


def test_pending_replica_explains_itself_node_by_node(now, profile):
    make_node("a", now=now, gpus=2)
    make_node("b", now=now)
    node_state("b", "cordoned", now=now)
    dep = deploy(profile)
    report = reconcile(now=now)
    assert report.pending == 1
    rep = Replica.objects.get(deployment=dep)
    assert rep.state == "pending"
    assert rep.pending_reasons == {"a": "2 free GPUs, needs 4", "b": "cordoned"}
    assert rep.reason == "2 free GPUs, needs 4 (a); cordoned (b)"
    node_state("b", "ready", now=now)
    reconcile(now=now)
    rep.refresh_from_db()
    assert (rep.state, rep.pending_reasons) == ("starting", {})


def test_startup_timeout_fails_the_replica(now):
    prof = EngineProfile.objects.create(name="slow", engine="echo", gpus_per_node=8, startup_timeout_s=60)
    make_node("a", now=now)
    dep = deploy(prof)
    reconcile(now=now)
    reconcile(now=now + dt.timedelta(seconds=61))
    reasons = list(Replica.objects.filter(deployment=dep, state="failed").values_list("reason", flat=True))
    assert reasons == ["not ready within the startup timeout (60 s)"]


def test_task_is_single_flight_and_a_dead_holder_blocks_nobody(now, profile):
    make_node("a", now=now)
    deploy(profile)
    other = other_session()
    assert other.execute("SELECT pg_try_advisory_lock(%s)", [locks.lock_key(LOCK_NAME)]).fetchone()[0]
    assert reconcile_task(now=now.isoformat()) is None
    assert Replica.objects.count() == 0
    # The holder dies (its session ends, as with kill -9): a pass runs as soon as the server has
    # noticed (a cache key held every pass off for its whole 90 s TTL).
    other.close()
    deadline = time.monotonic() + 5
    while (report := reconcile_task(now=now.isoformat())) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report is not None and report["placed"] == 1
    # And the pass let its own lock go.
    again = other_session()
    assert again.execute("SELECT pg_try_advisory_lock(%s)", [locks.lock_key(LOCK_NAME)]).fetchone()[0]
    again.close()


def test_steady_state_queries_do_not_grow_with_deployments(now, profile):
    from django.test.utils import CaptureQueriesContext

    for i in range(4):
        make_node(f"n{i}", now=now, gpus=16)

    def counted(n_deployments: int) -> int:
        for i in range(n_deployments):
            deploy(profile, name=f"d{n_deployments}-{i}")
        reconcile(now=now)
        all_ready(now)
        reconcile(now=now)
        with CaptureQueriesContext(connection) as ctx:
            reconcile(now=now)
        return len(ctx.captured_queries)

    small = counted(2)
    big = counted(6)
    # Orphaned claims, leftover shards, deployments, replicas, shards; the kept index's lease query.
    assert small == big == 7


def test_a_pass_with_nothing_pending_keeps_the_index_warm_for_the_next_scale_up(now, profile):
    from placement import kept

    kept.reset()
    for i in range(3):
        make_node(f"n{i}", now=now, gpus=8)
    reconcile(now=now)  # no deployment yet: the index is built now, not by the scale-up
    assert (kept.index().rebuilds, kept.index().reloaded) == (1, 0)
    deploy(profile, replicas=2)
    report = reconcile(now=now)
    assert report.placed == 2
    # The scale-up's pass found the index built: no second full build.
    assert kept.index().rebuilds == 1


def test_a_pass_placing_one_replica_costs_fourteen_statements(now, profile):
    from django.test.utils import CaptureQueriesContext

    for i in range(3):
        make_node(f"n{i}", now=now, gpus=8)
    dep = deploy(profile)
    reconcile(now=now)
    Deployment.objects.filter(id=dep.id).update(replicas=2)
    with CaptureQueriesContext(connection) as ctx:
        report = reconcile(now=now)
    assert (report.created, report.placed) == (1, 1)
    # Savepoints are the test's transaction around the pass's own; a pass run by the worker has none.
    sql = [q["sql"].split(" ", 1)[0] for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]]
    # Six reads (orphaned claims, leftover shards, deployments, replicas, shards, failed starts); the new
    # replica created under its deployment's lock (the lock, the live replicas, one insert of the replica and
    # its event); the lease query of the kept index; the placement (the replica's move, the allocation's id,
    # one insert of the allocation, GPUs, shard, command and event); the drained-nodes check.
    placing = ["UPDATE", "SELECT", "WITH"]
    assert sql == ["SELECT"] * 6 + ["SELECT", "SELECT", "WITH"] + ["SELECT"] + placing + ["SELECT"]
    assert Replica.objects.filter(deployment=dep, state="starting").count() == 2
    assert PlacementEvent.objects.filter(replica__deployment=dep, kind="created").count() == 2


def test_claims_of_a_deleted_replica_are_released(now):
    make_node("n1", now=now)
    gone, kept = uuid.uuid4(), uuid.uuid4()
    allocation.allocate(node_id="n1", replica_id=gone, shard_id=uuid.uuid4(), gpu_indices=[0, 1])
    dep = Deployment.objects.create(
        name="kept", served_model="m", profile=EngineProfile.objects.create(name="p", engine="echo"), replicas=0
    )
    Replica.objects.create(id=kept, deployment=dep, state="stopped", created_at=now, updated_at=now)
    allocation.allocate(node_id="n1", replica_id=kept, shard_id=uuid.uuid4(), gpu_indices=[2])
    assert release_orphans() == 1
    assert allocation.held_gpu_indices("n1") == [2]
    assert release_orphans() == 0


def test_start_shard_carries_the_profiles_startup_timeout(now):
    make_node("a", now=now)
    prof = EngineProfile.objects.create(name="slow", engine="echo", gpus_per_node=1, startup_timeout_s=600)
    deploy(prof, name="slow")
    reconcile(now=now)
    assert [c.payload["startup_timeout_s"] for c in commands("start_shard")] == [600.0]


def test_a_refusal_is_planned_once_per_deployment_while_nothing_is_placed(now, profile, monkeypatch):
    from placement import planner

    make_node("a", now=now, gpus=2)
    dep = deploy(profile, replicas=3)
    calls = []
    real_plan = planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a, **kw: calls.append(1) or real_plan(*a, **kw))
    report = reconcile(now=now)
    assert (report.created, report.pending, len(calls)) == (3, 3, 1)
    reasons = set(Replica.objects.filter(deployment=dep).values_list("reason", flat=True))
    assert reasons == {"2 free GPUs, needs 4 (a)"}


def test_a_pass_creates_no_replicas_when_another_created_some_since_it_read(now, profile):
    """Two passes that both read "1 of 3" must not both create two: the second finds the set changed."""
    dep = deploy(profile, replicas=3)
    other = Replica.objects.create(deployment=dep, created_at=now, updated_at=now)  # the other pass's
    ours = [Replica(deployment_id=dep.id, created_at=now, updated_at=now) for _ in range(3)]
    assert create_replicas(ours, {dep.id: set()}, now=now) == []
    assert list(Replica.objects.filter(deployment=dep).values_list("id", flat=True)) == [other.id]
    # Read after it: the pass's view holds, and it creates.
    assert len(create_replicas(ours[:2], {dep.id: {other.id}}, now=now)) == 2
    assert Replica.objects.filter(deployment=dep).count() == 3


def test_the_new_replicas_of_many_deployments_cost_three_statements_and_only_changed_ones_wait(now, profile):
    from django.test.utils import CaptureQueriesContext

    deps = [deploy(profile, name=f"d{i}", replicas=2) for i in range(5)]
    changed = deps[2]
    other = Replica.objects.create(deployment=changed, created_at=now, updated_at=now)  # another pass's
    ours = [Replica(deployment_id=d.id, created_at=now, updated_at=now, reason="new") for d in deps for _ in range(2)]
    with CaptureQueriesContext(connection) as ctx:
        created = create_replicas(ours, {d.id: set() for d in deps}, now=now)
    # The deployments locked in one statement, their live replicas read in one, the replicas and their events
    # inserted in one.
    assert len([q for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]]) == 3
    assert sorted({r.deployment_id for r in created}) == sorted(d.id for d in deps if d is not changed)
    assert list(Replica.objects.filter(deployment=changed).values_list("id", flat=True)) == [other.id]
    events = PlacementEvent.objects.filter(kind="created").values_list("replica_id", "to_state", "reason", "actor_name")
    assert sorted(events) == sorted((r.id, "pending", "new", "system") for r in created)


@pytest.mark.django_db(transaction=True)
def test_racing_reconcilers_place_exactly_the_desired_count(now, profile):
    for name in ("a", "b", "c"):
        make_node(name, now=now, gpus=8)
    dep = deploy(profile, replicas=4)
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def one_pass() -> None:
        try:
            barrier.wait(timeout=30)
            reconcile(now=now)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=one_pass) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    reconcile(now=now)
    live = Replica.objects.filter(deployment=dep).exclude(state__in=["stopped", "failed"])
    assert live.count() == 4
    assert live.filter(state="starting").count() == 4
    shards = list(Shard.objects.exclude(state__in=shard_states.TERMINAL).values_list("node_id", "http_port"))
    assert len(shards) == len(set(shards)) == 4
    gpus = list(AllocatedGPU.objects.values_list("node_id", "gpu_index"))
    assert len(gpus) == len(set(gpus)) == 16


def test_two_live_shards_never_share_a_node_and_port(now, profile):
    make_node("a", now=now)
    dep = deploy(profile)
    first = Replica.objects.create(deployment=dep, created_at=now, updated_at=now)
    second = Replica.objects.create(deployment=dep, created_at=now, updated_at=now)
    Shard.objects.create(replica=first, node_id="a", http_port=18000, state="stopped", created_at=now, updated_at=now)
    Shard.objects.create(replica=second, node_id="a", http_port=18000, state="ready", created_at=now, updated_at=now)
    with pytest.raises(IntegrityError, match="placement_shard_live_port_unique"), transaction.atomic():
        Shard.objects.create(
            replica=first, node_id="a", rank=1, http_port=18000, state="starting", created_at=now, updated_at=now
        )


def test_a_poison_profile_is_recorded_on_its_replica_and_the_pass_goes_on(now, profile):
    """An engine arg of 5,000 characters (the wire allows 4,096; the database's check counts the args, not their
    length) written straight to the database: only that deployment waits."""
    make_node("a", now=now, gpus=8)
    poison = EngineProfile.objects.create(name="poison", engine="echo", gpus_per_node=4, args=["x" * 5000])
    bad = deploy(poison, name="bad")
    good = deploy(profile, name="good")
    report = reconcile(now=now)
    assert (report.placed, report.errors) == (1, 1)
    assert states(good) == ["starting"]
    rep = Replica.objects.get(deployment=bad)
    assert rep.state == "pending" and rep.attempts == 1
    assert rep.reason.startswith("placement failed (ValidationError: ")
    assert rep.reason.endswith("; next try in 10 s")
    assert rep.not_before == now + dt.timedelta(seconds=10)
    event = PlacementEvent.objects.get(replica=rep, kind="placement_error")
    assert event.reason == rep.reason
    # Nothing of it was written: no allocation, shard or command.
    assert not Shard.objects.filter(replica=rep).exists()
    assert not Allocation.objects.filter(replica_id=rep.id).exists()
    # Not tried again before its time; then again, with a doubled wait.
    assert reconcile(now=now + dt.timedelta(seconds=5)).backing_off == 1
    assert Replica.objects.get(id=rep.id).attempts == 1
    assert reconcile(now=now + dt.timedelta(seconds=11)).errors == 1
    rep.refresh_from_db()
    assert (rep.attempts, rep.not_before) == (2, now + dt.timedelta(seconds=31))


def test_a_replica_that_keeps_failing_to_start_waits_longer_each_time_and_avoids_the_node(now, profile, settings):
    settings.LLMGW_AVOID_AFTER = 2
    make_node("a", now=now, gpus=4)
    make_node("b", now=now, gpus=4)
    dep = deploy(profile)
    t = now

    def fail_the_start(at) -> Replica:
        rep = Replica.objects.get(deployment=dep, state="starting")
        report_state(rep.shards.get(), "failed", now=at, reason="port 18000 in use")
        reconcile(now=at)
        return rep

    reconcile(now=t)
    first = Replica.objects.get(deployment=dep, state="starting")
    node = first.shards.get().node_id
    fail_the_start(t)
    waiting = Replica.objects.get(deployment=dep, state="pending")
    assert waiting.not_before == t + dt.timedelta(seconds=10)
    assert waiting.reason == (
        f"waiting 10 s before placing again: 1 failed start (last: shard 0 on {node} failed: port 18000 in use)"
    )
    assert reconcile(now=t + dt.timedelta(seconds=9)).backing_off == 1
    assert reconcile(now=t + dt.timedelta(seconds=10)).placed == 1
    second = Replica.objects.get(deployment=dep, state="starting")
    assert second.shards.get().node_id == node  # binpack, same node: one failure is not a pattern yet
    t += dt.timedelta(seconds=10)
    touch("a", now=t)
    touch("b", now=t)
    fail_the_start(t)
    waiting = Replica.objects.get(deployment=dep, state="pending")
    assert waiting.not_before == t + dt.timedelta(seconds=20)
    t += dt.timedelta(seconds=20)
    touch("a", now=t)
    touch("b", now=t)
    reconcile(now=t)
    third = Replica.objects.get(deployment=dep, state="starting")
    # Two failed starts on that node: the next replica goes elsewhere.
    assert third.shards.get().node_id == ({"a", "b"} - {node}).pop()
    # A replica that becomes ready resets the count.
    all_ready(t, replica=third)
    reconcile(now=t)
    assert start_failures({dep.id}, now=t) == {}


def test_a_ready_node_whose_lease_expired_gets_nothing_new(now, profile, settings):
    """The sweep has not marked it yet (or an operator action slipped it back to ready): still refused."""
    settings.LLMGW_UNREACHABLE_AFTER = 30
    make_node("a", now=now)
    make_node("b", now=now - dt.timedelta(seconds=31))
    dep = deploy(profile, replicas=3)
    report = reconcile(now=now)
    assert (report.placed, report.pending) == (2, 1)
    assert set(Shard.objects.values_list("node_id", flat=True)) == {"a"}
    waiting = Replica.objects.get(deployment=dep, state="pending")
    assert waiting.pending_reasons == {"a": "0 free GPUs, needs 4", "b": "no heartbeat for 31 s: lease expired"}
