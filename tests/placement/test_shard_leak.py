"""Shard ports come back: a replica retired before its shards started leaves no (node, port) held.

Commands travel in heartbeat answers; here the reconciler scales up and down
faster than they do, and the outbox is read the way a heartbeat reads it
(delivered, acknowledged) when the test says a heartbeat happened.
"""

from __future__ import annotations

import datetime as dt

import pytest

from inventory import outbox
from inventory.heartbeat import touch
from inventory.models import Command
from llmgw_wire import shard_states
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from placement.reconciler import reconcile
from placement.retiring import STOP_GRACE_S, release_leftover_shards
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def live_ports() -> list[tuple[str, int]]:
    return sorted(Shard.objects.exclude(state__in=shard_states.TERMINAL).values_list("node_id", "http_port"))


@pytest.fixture
def dep(now):
    make_node("a", now=now, mgmt_addr="10.0.0.1")
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    return Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=0)


def scale(dep: Deployment, n: int) -> None:
    dep.replicas = n
    dep.save(update_fields=["replicas"])


def test_scaling_up_and_down_faster_than_commands_travel_gives_every_port_back(now, dep):
    t = now
    for _ in range(5):
        scale(dep, 4)
        reconcile(now=t)
        assert len(live_ports()) == 4
        scale(dep, 0)
        t += dt.timedelta(seconds=1)
        reconcile(now=t)
        # No StartShard reached the agent: the shards end with their replicas, no stop to send.
        assert live_ports() == []
        t += dt.timedelta(seconds=1)
    assert not Command.objects.exists()
    assert set(Shard.objects.values_list("state", flat=True)) == {"stopped"}
    assert set(Replica.objects.values_list("state", flat=True)) == {"stopped"}
    released = PlacementEvent.objects.filter(kind="shard_released")
    assert released.count() == 20
    assert set(released.values_list("reason", flat=True)) == {"never started: scaled down"}
    # The next replicas get the lowest ports again, not the 21st onwards.
    scale(dep, 2)
    reconcile(now=t)
    assert live_ports() == [("a", 18000), ("a", 18001)]


def test_a_start_delivered_in_an_answer_the_agent_never_got_is_swept(now, dep):
    scale(dep, 1)
    reconcile(now=now)
    # A heartbeat's answer carried the StartShard; the agent never received it (the answer was lost).
    assert [c.kind for c in outbox.pending("a", now=now)] == ["start_shard"]
    scale(dep, 0)
    reconcile(now=now + dt.timedelta(seconds=1))
    rep = Replica.objects.get()
    # It may have started: the replica drains, the agent is told to stop it, its port still held.
    assert rep.state == "draining"
    assert live_ports() == [("a", 18000)]
    (stop,) = outbox.pending("a", now=now + dt.timedelta(seconds=2))
    assert stop.kind == "stop_shard"
    # The agent knows no such shard: it acknowledges the stop and reports nothing about it.
    outbox.acknowledge("a", [stop.id], now=now + dt.timedelta(seconds=2))
    t = now + dt.timedelta(seconds=200)
    reconcile(now=t)
    assert Replica.objects.get().state == "stopped"
    # Not swept before its stop has settled...
    assert release_leftover_shards(now=t) == 0
    assert live_ports() == [("a", 18000)]
    # ...then released, with an event saying why; the port is handed out again.
    assert release_leftover_shards(now=t + dt.timedelta(seconds=STOP_GRACE_S + 1)) == 1
    assert live_ports() == []
    event = PlacementEvent.objects.get(kind="shard_released")
    assert (event.from_state, event.to_state, event.reason) == (
        "pending",
        "stopped",
        "never started; released after its replica ended",
    )
    scale(dep, 1)
    later = t + dt.timedelta(seconds=STOP_GRACE_S + 2)
    touch("a", now=later)  # its heartbeats went on meanwhile
    reconcile(now=later)
    assert live_ports() == [("a", 18000)]


def test_a_shard_whose_stop_is_not_acknowledged_keeps_its_port(now, dep):
    scale(dep, 1)
    reconcile(now=now)
    outbox.pending("a", now=now)
    scale(dep, 0)
    reconcile(now=now + dt.timedelta(seconds=1))
    # The node is silent: its agent may run the engine, and it has not heard the stop.
    reconcile(now=now + dt.timedelta(hours=1))
    assert Replica.objects.get().state == "stopped"
    assert release_leftover_shards(now=now + dt.timedelta(hours=2)) == 0
    assert live_ports() == [("a", 18000)]
