"""Adoption and fencing at registration, shard states from heartbeats."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

import llmgw_wire as wire
from inventory.models import Command
from placement import agent_sync
from placement.models import PlacementEvent, Shard
from tests.agents.conftest import make_shard
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def running(shard, state="ready", **kw) -> wire.RunningShard:
    return wire.RunningShard(replica_id=str(shard.replica_id), shard_id=str(shard.id), state=state, **kw)


def status(shard_id, state, **kw) -> wire.ShardStatus:
    return wire.ShardStatus.model_validate({"shard_id": str(shard_id), "state": state, **kw})


def stops(node_id="node-a") -> list[tuple[str, str]]:
    return [(c.shard_id, c.payload["reason"]) for c in Command.objects.filter(node_id=node_id, kind="stop_shard")]


def test_known_shards_are_adopted_as_they_run(now):
    make_node("node-a", now=now)
    ready = make_shard("node-a", now=now, state="ready")
    loading = make_shard("node-a", now=now, state="starting")
    result = agent_sync.adopt_running("node-a", [running(ready), running(loading, "loading")], now=now)
    assert sorted(result.adopted) == sorted([str(ready.id), str(loading.id)])
    assert result.fenced == [] and stops() == []
    assert Shard.objects.get(id=loading.id).state == "loading"
    ev = PlacementEvent.objects.get()
    assert (ev.kind, ev.from_state, ev.to_state, ev.shard_id, ev.actor_name) == (
        "adopted",
        "starting",
        "loading",
        loading.id,
        "agent",
    )


def test_unknown_gone_and_written_off_shards_are_fenced(now):
    make_node("node-a", now=now)
    make_node("node-b", now=now)
    stranger = wire.RunningShard(replica_id="r", shard_id=str(uuid.uuid4()), state="ready")
    alien = wire.RunningShard(replica_id="r", shard_id="not-ours", state="ready")
    elsewhere = make_shard("node-b", now=now)
    stopped_replica = make_shard("node-a", now=now, replica_state="stopped")
    lost = make_shard("node-a", now=now, state="failed")
    Shard.objects.filter(id=lost.id).update(reason="node lost")
    result = agent_sync.adopt_running(
        "node-a", [stranger, alien, running(elsewhere), running(stopped_replica), running(lost)], now=now
    )
    assert result.adopted == []
    assert sorted(stops()) == sorted(
        [
            (stranger.shard_id, "shard unknown to the control plane"),
            ("not-ours", "shard unknown to the control plane"),
            (str(elsewhere.id), "shard unknown to the control plane"),
            (str(stopped_replica.id), "replica is stopped"),
            (str(lost.id), "shard is failed: node lost"),
        ]
    )
    # The other node's shard is untouched, and a second registration does not queue the stops twice.
    assert Shard.objects.get(id=elsewhere.id).state == "ready"
    agent_sync.adopt_running("node-a", [stranger, running(lost)], now=now)
    assert Command.objects.filter(kind="stop_shard").count() == 5


def test_shards_not_reported_at_registration_are_failed_unless_still_to_start(now):
    make_node("node-a", now=now)
    vanished = make_shard("node-a", now=now, state="ready")
    pending = make_shard("node-a", now=now, state="pending")
    starting = make_shard("node-a", now=now, state="starting")
    from inventory import outbox

    outbox.enqueue(
        "node-a",
        wire.StartShard(
            replica_id=str(starting.replica_id),
            shard_id=str(starting.id),
            http_port=8000,
            profile=wire.EngineProfile(engine="echo"),
        ),
        now=now,
    )
    result = agent_sync.adopt_running("node-a", [], now=now)
    assert result.failed_missing == [str(vanished.id)]
    assert {s.id: s.state for s in Shard.objects.all()} == {
        vanished.id: "failed",
        pending.id: "pending",
        starting.id: "starting",
    }
    assert Shard.objects.get(id=vanished.id).reason == "not running when the agent registered"


def test_heartbeat_states_are_recorded_with_events(now):
    make_node("node-a", now=now)
    s1 = make_shard("node-a", now=now, state="starting")
    s2 = make_shard("node-a", now=now, state="ready")
    later = now + dt.timedelta(seconds=5)
    result = agent_sync.record_shard_states(
        "node-a", [status(s1.id, "loading", reason="42%"), status(s2.id, "ready")], now=later
    )
    assert result.changed == [(str(s1.id), "starting", "loading")]
    row = Shard.objects.get(id=s1.id)
    assert (row.state, row.reason, row.updated_at) == ("loading", "42%", later)
    assert PlacementEvent.objects.count() == 1
    # Same state, new detail: the row changes, no event.
    agent_sync.record_shard_states("node-a", [status(s1.id, "loading", reason="80%")], now=later)
    assert Shard.objects.get(id=s1.id).reason == "80%" and PlacementEvent.objects.count() == 1


def test_unknown_state_reads_as_failed(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="ready")
    agent_sync.record_shard_states("node-a", [status(s.id, "hibernating", exit_code=137)], now=now)
    row = Shard.objects.get(id=s.id)
    assert (row.state, row.exit_code) == ("failed", 137)


def test_terminal_states_stick_and_live_reports_of_them_are_fenced(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="failed")
    result = agent_sync.record_shard_states("node-a", [status(s.id, "ready")], now=now)
    assert Shard.objects.get(id=s.id).state == "failed"
    assert result.fenced == [str(s.id)] and len(stops()) == 1
    agent_sync.record_shard_states("node-a", [status(s.id, "ready")], now=now)
    assert len(stops()) == 1
    agent_sync.record_shard_states("node-a", [status(s.id, "stopped")], now=now)
    assert Shard.objects.get(id=s.id).state == "stopped"


def test_a_node_cannot_report_another_nodes_shard(now):
    make_node("node-a", now=now)
    make_node("node-b", now=now)
    theirs = make_shard("node-b", now=now, state="ready")
    agent_sync.record_shard_states("node-a", [status(theirs.id, "failed")], now=now)
    assert Shard.objects.get(id=theirs.id).state == "ready"
    assert PlacementEvent.objects.count() == 0


def test_fail_node_shards(now):
    make_node("node-a", now=now)
    live = make_shard("node-a", now=now, state="ready")
    done = make_shard("node-a", now=now, state="stopped")
    assert agent_sync.fail_node_shards("node-a", reason="node lost", now=now) == [str(live.id)]
    assert Shard.objects.get(id=live.id).reason == "node lost"
    assert Shard.objects.get(id=done.id).state == "stopped"
    ev = PlacementEvent.objects.get()
    assert (ev.from_state, ev.to_state, ev.reason, ev.actor_name) == ("ready", "failed", "node lost", "system")


def test_a_fenced_shard_that_is_draining_is_not_fenced_again(now):
    from inventory import outbox

    make_node("node-a", now=now)
    stranger = str(uuid.uuid4())
    written_off = make_shard("node-a", now=now, state="failed")
    reports = [status(stranger, "ready", replica_id="r"), status(written_off.id, "ready")]
    result = agent_sync.record_shard_states("node-a", reports, now=now)
    assert sorted(result.fenced) == sorted([stranger, str(written_off.id)])
    # The agent applies the stops and acknowledges them; its shards drain until their processes end.
    outbox.acknowledge("node-a", [str(c.id) for c in Command.objects.all()], now=now)
    draining = [status(stranger, "draining", replica_id="r"), status(written_off.id, "draining")]
    for _ in range(3):
        assert agent_sync.record_shard_states("node-a", draining, now=now).fenced == []
    assert Command.objects.filter(kind="stop_shard").count() == 2
    # A restarted agent offering them while they drain is not told again either.
    offered = [
        wire.RunningShard(replica_id="r", shard_id=stranger, state="draining"),
        running(written_off, "draining"),
        wire.RunningShard(replica_id="r", shard_id="not-ours", state="draining"),
    ]
    assert agent_sync.adopt_running("node-a", offered, now=now).fenced == []
    assert Command.objects.filter(kind="stop_shard").count() == 2
    # One that runs again (not draining) is fenced again.
    assert agent_sync.record_shard_states("node-a", [status(stranger, "ready", replica_id="r")], now=now).fenced == [
        stranger
    ]
    assert Command.objects.filter(kind="stop_shard", acked_at__isnull=True).count() == 1


# The end of an engine's log as an older agent sent it: unredacted, with no cause in the reason.
RAW_TAIL = [
    "# llmgw-agent: starting ['vllm', 'serve', '--api-key', '***']",
    "INFO vLLM API server version 0.11.0 with --api-key s3cret",
    "INFO env HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123",
    "Traceback (most recent call last):",
    '  File "/venv/vllm/entrypoints/api_server.py", line 9, in run',
    "OSError: [Errno 98] Address already in use",
]
CAUSE = "the engine exited with code 1: OSError: [Errno 98] Address already in use"


def test_a_failed_shard_keeps_its_engines_output_redacted_and_its_cause(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="loading")
    reported = status(s.id, "failed", reason="the engine exited with code 1", exit_code=1, log_tail=RAW_TAIL)
    agent_sync.record_shard_states("node-a", [reported], now=now)
    row = Shard.objects.get(id=s.id)
    assert (row.state, row.reason, row.exit_code) == ("failed", CAUSE, 1)
    assert row.output_tail == "\n".join(
        [
            "# llmgw-agent: starting ['vllm', 'serve', '--api-key', '***']",
            "INFO vLLM API server version 0.11.0 with --api-key ***",
            "INFO env HF_TOKEN=***",
            "Traceback (most recent call last):",
            '  File "/venv/vllm/entrypoints/api_server.py", line 9, in run',
            "OSError: [Errno 98] Address already in use",
        ]
    )
    ev = PlacementEvent.objects.get()
    assert (ev.kind, ev.from_state, ev.to_state, ev.reason) == ("shard_state", "loading", "failed", CAUSE)


def test_a_reason_that_names_its_cause_is_kept_as_it_is(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="loading")
    agent_sync.record_shard_states("node-a", [status(s.id, "failed", reason=CAUSE, log_tail=RAW_TAIL)], now=now)
    assert Shard.objects.get(id=s.id).reason == CAUSE


def test_a_stored_tail_is_bounded(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="loading")
    # The most the wire lets through: 50 lines of 4,096 characters.
    lines = [f"line {i:02d} " + "x" * 4088 for i in range(50)]
    agent_sync.record_shard_states("node-a", [status(s.id, "failed", log_tail=lines)], now=now)
    row = Shard.objects.get(id=s.id)
    assert row.output_tail.split("\n") == [line[:1023] + "…" for line in lines[-7:]]
    assert len(row.output_tail.encode()) <= wire.TAIL_BYTES
    assert row.reason == "its last output: " + lines[-1][:299] + "…"


def test_a_tail_is_stored_only_when_the_shard_fails(now):
    make_node("node-a", now=now)
    s = make_shard("node-a", now=now, state="starting")
    agent_sync.record_shard_states("node-a", [status(s.id, "loading", log_tail=RAW_TAIL)], now=now)
    assert Shard.objects.get(id=s.id).output_tail == ""
