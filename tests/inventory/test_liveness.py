"""The liveness sweep: ready -> unreachable -> lost, and what lost means for shards."""

from __future__ import annotations

import datetime as dt

import pytest

from agents.tasks import liveness_sweep
from inventory import liveness
from inventory.models import Node, NodeEvent, NodeState
from inventory.nodes import change_state
from placement.models import PlacementEvent, Shard
from tests.agents.conftest import make_shard
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def at(now, seconds):
    return now + dt.timedelta(seconds=seconds)


def state(node_id="node-a"):
    return Node.objects.values_list("state", "unreachable_since").get(id=node_id)


def test_ready_unreachable_lost(now, settings):
    settings.LLMGW_UNREACHABLE_AFTER = 30
    settings.LLMGW_LOST_AFTER = 300
    make_node("node-a", now=now)
    shard = make_shard("node-a", now=now, state="ready")
    assert liveness.sweep(now=at(now, 29)).unreachable == []
    result = liveness.sweep(now=at(now, 31))
    assert result.unreachable == ["node-a"]
    assert state() == (NodeState.UNREACHABLE, at(now, 31))
    assert Shard.objects.get(id=shard.id).state == "ready"
    assert liveness.sweep(now=at(now, 299)).lost == []
    result = liveness.sweep(now=at(now, 301))
    assert result.lost == ["node-a"] and result.failed_shards == [str(shard.id)]
    assert state()[0] == NodeState.LOST
    row = Shard.objects.get(id=shard.id)
    assert (row.state, row.reason) == ("failed", "node lost")
    assert PlacementEvent.objects.get().to_state == "failed"
    messages = list(
        NodeEvent.objects.filter(node_id="node-a", kind="state").order_by("at").values_list("message", flat=True)
    )
    assert messages == ["ready -> unreachable: no heartbeat for 30 s", "unreachable -> lost: no heartbeat for 300 s"]
    # Idempotent.
    again = liveness.sweep(now=at(now, 400))
    assert (again.unreachable, again.lost, again.failed_shards) == ([], [], [])


def test_long_silence_goes_both_steps_in_one_sweep(now):
    make_node("node-a", now=now)
    result = liveness.sweep(now=at(now, 3600))
    assert (result.unreachable, result.lost) == (["node-a"], ["node-a"])


def test_a_fresh_heartbeat_wins_over_the_sweep(now):
    make_node("node-a", now=now)
    # The sweep saw it silent, but it heartbeated before the lock was taken.
    Node.objects.filter(id="node-a").update(last_seen=at(now, 100))
    assert not liveness.mark_unreachable("node-a", now=at(now, 101), cutoff=at(now, 71))
    assert state()[0] == NodeState.READY


@pytest.mark.parametrize("operator_state", [NodeState.CORDONED, NodeState.DRAINING])
def test_cordoned_and_draining_keep_their_state_but_are_flagged(now, operator_state):
    make_node("node-a", now=now)
    change_state("node-a", operator_state, now=now)
    shard = make_shard("node-a", now=now, state="ready")
    result = liveness.sweep(now=at(now, 31))
    assert result.flagged == ["node-a"] and result.unreachable == []
    assert state() == (operator_state, at(now, 31))
    assert liveness.sweep(now=at(now, 60)).flagged == []
    # Silent past the lost delay: its shards are dead, its state is the operator's.
    result = liveness.sweep(now=at(now, 301))
    assert result.failed_shards == [str(shard.id)] and result.lost == []
    assert state()[0] == operator_state
    assert Shard.objects.get(id=shard.id).state == "failed"


def test_the_task_runs_the_sweep(now):
    make_node("node-a", now=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    assert liveness_sweep() == {"unreachable": 1, "lost": 1, "flagged": 0, "failed_shards": 0}
    assert liveness_sweep() == {"unreachable": 0, "lost": 0, "flagged": 0, "failed_shards": 0}


def test_beat_schedules_the_sweep(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["agents.liveness_sweep"]
    assert entry == {"task": "agents.liveness_sweep", "schedule": 10.0}


def test_silent_cordoned_nodes_cost_the_sweep_no_query_each(now, django_assert_num_queries):
    def silent_cordoned(node_id: str) -> None:
        make_node(node_id, now=now)
        change_state(node_id, NodeState.CORDONED, now=now)
        make_shard(node_id, now=now, state="stopped")
        make_shard(node_id, now=now, state="failed")

    silent_cordoned("node-a")
    liveness.sweep(now=at(now, 31))  # flags it
    with django_assert_num_queries(4):
        assert liveness.sweep(now=at(now, 301)).failed_shards == []
    for i in range(5):
        silent_cordoned(f"node-{i}")
    liveness.sweep(now=at(now, 31))
    # Shards that are over leave the node alone, and more such nodes cost nothing more.
    with django_assert_num_queries(4):
        assert liveness.sweep(now=at(now, 301)).failed_shards == []
    assert PlacementEvent.objects.count() == 0
