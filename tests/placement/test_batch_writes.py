"""Placements written in batches: the same rows as one at a time, a conflict costing only itself."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from inventory import allocation
from inventory.models import AllocatedGPU, Allocation, Command
from placement import batch_writes, planner, queueing, writes
from placement import snapshot_db as snapshots
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from placement.placing import write_placement
from placement.reconciler import Report, reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def cluster(now):
    """Three nodes of eight cards, two deployments of two-card replicas, six pending replicas."""
    for i, n in enumerate(("a", "b", "c")):
        make_node(n, now=now, mgmt_addr=f"10.0.0.{i + 1}")
    prof = EngineProfile.objects.create(name="echo-2", engine="echo", gpus_per_node=2, memory_gb=8, env={"X": "1"})
    deps = [
        Deployment.objects.create(name=f"d{i}", served_model=f"m{i}", profile=prof, replicas=3, pool="blue")
        for i in range(2)
    ]
    for d in deps:
        for k in range(3):
            Replica.objects.create(id=uuid.UUID(int=d.id * 100 + k), deployment=d, created_at=now, updated_at=now)
    return deps


def pending_rows() -> list[Replica]:
    return list(Replica.objects.filter(state="pending").order_by("created_at", "id"))


def deployments() -> dict[int, Deployment]:
    return {d.id: d for d in Deployment.objects.select_related("profile")}


def plan_all(rows, deps, snap) -> list[planner.Plan]:
    plans = []
    for row in rows:
        dep = deps[row.deployment_id]
        result = planner.plan(planner.ReplicaRequest.from_profile(dep.profile), snap, policy=dep.policy)
        assert isinstance(result, planner.Plan)
        snap.reserve(result)
        plans.append(result)
    return plans


def _values(qs, drop=()) -> list[str]:
    return sorted(json.dumps({k: v for k, v in r.items() if k not in drop}, sort_keys=True, default=str) for r in qs)


def dump() -> dict[str, list[str]]:
    """Every row a placement writes, without the keys the database or the model assigns."""
    held = {a.id: sorted(a.gpus.values_list("gpu_index", flat=True)) for a in Allocation.objects.all()}
    return {
        "allocations": _values(
            ({**a, "gpus": held[a["id"]]} for a in Allocation.objects.values()), drop=("id", "created_at")
        ),
        "gpus": _values(AllocatedGPU.objects.values("node_id", "gpu_index")),
        "shards": _values(Shard.objects.values()),
        "commands": _values(Command.objects.values(), drop=("id",)),
        "replicas": _values(Replica.objects.values()),
        "events": _values(PlacementEvent.objects.values(), drop=("id",)),
    }


@pytest.fixture
def fixed_uuids(monkeypatch):
    """Shard ids from a counter, so two runs draw the same ones."""

    def reset():
        counter = itertools.count(1)
        monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=10**9 + next(counter)))

    return reset


def test_a_batch_writes_exactly_the_rows_of_single_writes(now, cluster, fixed_uuids):
    deps = deployments()
    plans = plan_all(pending_rows(), deps, snapshots.build(now=now))
    snap = snapshots.build(now=now)

    fixed_uuids()
    with transaction.atomic():
        rows = pending_rows()
        for row, plan in zip(rows, plans, strict=True):
            with transaction.atomic():
                write_placement(row, deps[row.deployment_id], plan, snap, now=now)
        single, single_objs = dump(), [(r.state, r.reason, r.endpoint, r.pending_reasons) for r in rows]
        transaction.set_rollback(True)

    fixed_uuids()
    with transaction.atomic():
        rows = pending_rows()
        writer = batch_writes.BatchWriter(snap, now=now)
        for row, plan in zip(rows, plans, strict=True):
            writer.add(row, deps[row.deployment_id], plan)
        writer.flush()
        batched, batched_objs = dump(), [(r.state, r.reason, r.endpoint, r.pending_reasons) for r in rows]
        transaction.set_rollback(True)
    assert (len(writer.placed), writer.conflicts, writer.failed) == (6, [], [])
    assert len(single["shards"]) == 6 and len(single["commands"]) == 6 and len(single["events"]) == 6
    assert batched == single
    # The pass goes on with the row objects: they read as the single writer leaves them.
    assert batched_objs == single_objs


def test_statements_do_not_grow_with_the_batch(now, cluster):
    deps = deployments()
    snap = snapshots.build(now=now)
    rows = pending_rows()
    plans = plan_all(rows, deps, snapshots.build(now=now))
    counts = []
    for n in (1, 2, 6):
        with transaction.atomic():
            batch = [
                writes.placement_rows(r, deps[r.deployment_id], p, snap, now=now)
                for r, p in zip(rows[:n], plans[:n], strict=True)
            ]
            with CaptureQueriesContext(connection) as q:
                writes.write(batch, now=now)
            counts.append(len(q.captured_queries))
            transaction.set_rollback(True)
    # The replicas' move, the allocations' ids and one insert into every table; several replicas are locked
    # in id order first.
    assert counts == [3, 4, 4]


def test_a_conflict_rolls_back_only_itself_and_queues_a_pass(
    now, cluster, django_capture_on_commit_callbacks, monkeypatch
):
    sent: list[str] = []
    monkeypatch.setattr(queueing.app, "send_task", lambda name, *a, **kw: sent.append(name))
    deps = deployments()
    snap = snapshots.build(now=now)
    rows = pending_rows()
    plans = plan_all(rows, deps, snapshots.build(now=now))
    # Another writer took one card of the third placement after this pass planned it.
    taken = plans[2].shards[0]
    allocation.allocate(
        node_id=taken.node_id, replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[taken.gpu_indices[1]]
    )
    # And another pass placed the fifth replica's row meanwhile (here: retired it).
    Replica.objects.filter(id=rows[4].id).update(state="stopped")

    report = Report()
    writer = batch_writes.BatchWriter(snap, now=now)
    with django_capture_on_commit_callbacks(execute=True):
        for row, plan in zip(rows, plans, strict=True):
            writer.add(row, deps[row.deployment_id], plan)
            report.placed += 1
        assert writer.close(report) == []
    assert (report.placed, report.pending, report.conflicts, report.errors) == (4, 2, 2, 0)
    assert [r.state for r in rows] == ["starting", "starting", "pending", "starting", "pending", "starting"]
    assert Replica.objects.get(id=rows[2].id).state == "pending"
    for loser in (rows[2], rows[4]):
        assert not Shard.objects.filter(replica_id=loser.id).exists()
        assert not Allocation.objects.filter(replica_id=loser.id).exists()
        assert not Command.objects.filter(payload__replica_id=str(loser.id)).exists()
    assert Shard.objects.count() == 4 and Command.objects.count() == 4
    assert sorted(Replica.objects.values_list("state", flat=True)) == [
        "pending",
        "starting",
        "starting",
        "starting",
        "starting",
        "stopped",
    ]
    assert sent == ["placement.reconcile"]


def test_a_full_batch_is_written_at_once(now, cluster):
    deps = deployments()
    snap = snapshots.build(now=now)
    rows = pending_rows()
    writer = batch_writes.BatchWriter(snap, now=now, batch_size=4)
    for row, plan in zip(rows, plan_all(rows, deps, snapshots.build(now=now)), strict=True):
        writer.add(row, deps[row.deployment_id], plan)
    # Four written when the batch filled; two wait for the close.
    assert Replica.objects.filter(state="starting").count() == 4
    writer.close(Report(placed=6))
    assert Replica.objects.filter(state="starting").count() == 6


def test_a_scale_up_pass_writes_in_batches(now, profile_scale=16):
    make_node("a", now=now, gpus=8)
    for i in range(1, profile_scale // 8 * 2 + 1):
        make_node(f"n{i}", now=now, gpus=8)
    prof = EngineProfile.objects.create(name="one", engine="echo", gpus_per_node=1)

    def placed(n: int) -> int:
        dep = Deployment.objects.create(name=f"s{n}", served_model=f"s{n}", profile=prof, replicas=n)
        with CaptureQueriesContext(connection) as q:
            report = reconcile(now=now)
        assert (report.created, report.placed, report.pending) == (n, n, 0)
        assert Replica.objects.filter(deployment=dep, state="starting").count() == n
        dep.paused = True
        dep.save()
        return len(q.captured_queries)

    small, large = placed(4), placed(profile_scale)
    # Twelve more placements, not twelve more times eleven statements.
    assert large - small < 12
