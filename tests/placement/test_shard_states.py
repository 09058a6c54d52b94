"""The one shard state machine, as the heartbeat path, the agent and the database apply it."""

from __future__ import annotations

import pytest

import llmgw_wire as wire
from llmgw_agent import supervisor
from llmgw_wire import shard_states
from placement import agent_sync, replicas
from placement.models import PlacementEvent, Shard
from tests.agents.conftest import make_shard
from tests.factories import make_node

EVERY = [s.value for s in wire.ShardState]


def test_one_table_covers_every_wire_state_and_everyone_uses_it():
    assert set(shard_states.TRANSITIONS) == set(EVERY)
    assert {"stopped", "failed"} == shard_states.TERMINAL
    assert set(EVERY) - {"stopped", "failed"} == shard_states.LIVE
    # The heartbeat path, the reconciler's helpers and the agent read the same sets.
    assert agent_sync.TERMINAL is shard_states.TERMINAL and agent_sync.LIVE is shard_states.LIVE
    assert replicas.SHARD_DONE is shard_states.TERMINAL and replicas.SHARD_TRANSITIONS is shard_states.TRANSITIONS
    assert {s.value for s in supervisor.TERMINAL} == shard_states.TERMINAL
    for old in EVERY:
        for new in EVERY:
            assert agent_sync.allowed(old, new) == (new in shard_states.TRANSITIONS[old]), (old, new)


@pytest.mark.parametrize(
    ("old", "new", "moves"),
    [
        ("ready", "starting", False),  # the two tables used to disagree here
        ("failed", "stopped", True),  # and here: the process of a written-off shard has ended
        ("failed", "ready", False),
        ("stopped", "ready", False),
        ("ready", "loading", True),
        ("pending", "ready", True),
        ("draining", "stopped", True),
        ("starting", "pending", False),
    ],
)
@pytest.mark.django_db
def test_the_heartbeat_path_moves_only_what_the_table_allows(now, old, new, moves):
    make_node("node-a", now=now)
    shard = make_shard("node-a", now=now, state=old)
    status = wire.ShardStatus(shard_id=str(shard.id), replica_id=str(shard.replica_id), state=new)
    agent_sync.record_shard_states("node-a", [status], now=now)
    assert Shard.objects.get(id=shard.id).state == (new if moves else old)
    assert PlacementEvent.objects.filter(shard_id=shard.id, to_state=new).exists() == moves
