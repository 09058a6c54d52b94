"""Two reconcilers racing on PostgreSQL, each with its own connection: no GPU is booked twice."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from inventory.models import AllocatedGPU, Allocation, Command
from placement import snapshot_db
from placement.models import Deployment, EngineProfile, Replica, Shard
from placement.placing import place
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db(transaction=True)


def _run_in_threads(*targets):
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)
            finally:
                connections.close_all()

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_two_placements_from_stale_snapshots_cannot_double_book(now):
    assert connection.vendor == "postgresql"
    make_node("a", now=now)
    prof = EngineProfile.objects.create(name="full", engine="echo", gpus_per_node=8)
    deps = [Deployment.objects.create(name=f"d{i}", served_model=f"m{i}", profile=prof, replicas=1) for i in range(2)]
    rows = [Replica.objects.create(deployment=d, created_at=now, updated_at=now) for d in deps]
    barrier = threading.Barrier(2)
    outcomes: dict[int, str] = {}

    def placer(i):
        def run():
            dep = Deployment.objects.select_related("profile").get(id=deps[i].id)
            row = Replica.objects.get(id=rows[i].id)
            snap = snapshot_db.build()
            # Both have seen node a with eight free cards before either writes.
            barrier.wait(timeout=30)
            outcomes[i] = place(row, dep, snap, {}, now=now)

        return run

    _run_in_threads(placer(0), placer(1))
    assert sorted(outcomes.values()) == ["conflict", "placed"]
    loser = rows[0] if outcomes[0] == "conflict" else rows[1]
    winner = rows[1] if loser is rows[0] else rows[0]
    # The loser rolled back its whole placement: no allocation, no shard, no command, still pending.
    assert Replica.objects.get(id=loser.id).state == "pending"
    assert not Allocation.objects.filter(replica_id=loser.id).exists()
    assert not Shard.objects.filter(replica_id=loser.id).exists()
    assert Command.objects.count() == 1
    assert Replica.objects.get(id=winner.id).state == "starting"
    assert sorted(AllocatedGPU.objects.values_list("gpu_index", flat=True)) == list(range(8))


def test_two_full_passes_at_once_never_double_book(now):
    for n in ("a", "b"):
        make_node(n, now=now)
    prof = EngineProfile.objects.create(name="half", engine="echo", gpus_per_node=4)
    for i in range(3):
        Deployment.objects.create(name=f"d{i}", served_model=f"m{i}", profile=prof, replicas=2)
    barrier = threading.Barrier(2)

    def passer():
        barrier.wait(timeout=30)
        reconcile(now=now)

    _run_in_threads(passer, passer)
    held = list(AllocatedGPU.objects.values_list("node_id", "gpu_index"))
    assert len(held) == len(set(held))
    shards = list(Shard.objects.values_list("node_id", "gpu_indices"))
    cards = [(n, i) for n, idx in shards for i in idx]
    assert len(cards) == len(set(cards)) == len(held)
    # A later pass settles the count the race may have overshot.
    reconcile(now=now)
    assert Allocation.objects.count() == 4
