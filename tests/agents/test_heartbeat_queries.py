"""A heartbeat costs a small, constant number of SQL queries, whatever it carries."""

from __future__ import annotations

import pytest

import llmgw_wire as wire
from inventory import outbox
from tests.agents.conftest import heartbeat_payload, make_shard, post

pytestmark = pytest.mark.django_db


def realistic(shards, *, at: float, counters: int, **extra) -> dict:
    return heartbeat_payload(
        at=at,
        counters=counters,
        shards=[{"shard_id": str(s.id), "replica_id": str(s.replica_id), "state": "ready"} for s in shards],
        engine_installs=[{"engine": "vllm", "version": "0.11.0", "state": "ready"}],
        imex={"state": "UP", "channels": 2048},
        **extra,
    )


def test_steady_state_heartbeat_query_count(client, joined, now, django_assert_num_queries):
    shards = [make_shard("node-a", now=now, rank=0), *[make_shard("node-a", now=now) for _ in range(3)]]
    fabrics = [
        {"index": i, "fabric": {"state": "Completed", "status": "Success", "cluster_uuid": "c1", "clique_id": "7"}}
        for i in range(8)
    ]
    # The first one applies installs, IMEX and fabrics; the ones after find nothing new.
    assert (
        post(client, "heartbeat", realistic(shards, at=1.0, counters=10, gpu_fabrics=fabrics), joined).status_code
        == 200
    )
    # The credential lookup with the lease update (returning the node); the shards read with the pending commands.
    with django_assert_num_queries(2 + 2):  # + the savepoint pair of the test's transaction
        resp = post(client, "heartbeat", realistic(shards, at=6.0, counters=20, gpu_fabrics=fabrics), joined)
    assert resp.status_code == 200
    with django_assert_num_queries(4):
        resp = post(client, "heartbeat", realistic(shards, at=11.0, counters=30), joined)
    assert resp.status_code == 200


def test_a_node_with_no_shards_and_no_commands_costs_one_statement(client, joined, now, django_assert_num_queries):
    # Most of a large fleet: the lease renewal says no command waits, and the outbox is not read.
    post(client, "heartbeat", realistic([], at=1.0, counters=10), joined)
    with django_assert_num_queries(1 + 2):  # + the savepoint pair of the test's transaction
        body = post(client, "heartbeat", realistic([], at=2.0, counters=10), joined).json()
    assert body["commands"] == []
    # A command queued meanwhile is seen by the same statement, read and delivered.
    cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=now)
    with django_assert_num_queries(3 + 2):
        body = post(client, "heartbeat", realistic([], at=3.0, counters=10), joined).json()
    assert [c["id"] for c in body["commands"]] == [str(cmd.id)]


def test_heartbeat_with_a_command_and_an_ack(client, joined, now, django_assert_num_queries):
    shards = [make_shard("node-a", now=now) for _ in range(4)]
    post(client, "heartbeat", realistic(shards, at=1.0, counters=10), joined)
    cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=now)
    # + marking the delivered command.
    with django_assert_num_queries(5):
        assert len(post(client, "heartbeat", realistic(shards, at=2.0, counters=10), joined).json()["commands"]) == 1
    # + the acknowledgement; nothing left to mark.
    with django_assert_num_queries(5):
        body = post(client, "heartbeat", realistic(shards, at=3.0, counters=10, acks=[str(cmd.id)]), joined).json()
    assert body["commands"] == []


def test_a_failed_shards_output_costs_no_statement_of_its_own(client, joined, now, django_assert_num_queries):
    loading, failing = make_shard("node-a", now=now, state="starting"), make_shard("node-a", now=now, state="loading")
    post(client, "heartbeat", heartbeat_payload(at=1.0, counters=10), joined)

    def reporting(shard, state: str, **detail) -> dict:
        return heartbeat_payload(at=2.0, counters=10, shards=[{"shard_id": str(shard.id), "state": state, **detail}])

    # A shard that moves: the steady state's four, + its update and its event.
    with django_assert_num_queries(6):
        assert post(client, "heartbeat", reporting(loading, "loading"), joined).status_code == 200
    # One that fails with the end of its log: the same statements.
    tail = [f"engine: line {i}" for i in range(40)] + ["OSError: [Errno 98] Address already in use"]
    with django_assert_num_queries(6):
        resp = post(client, "heartbeat", reporting(failing, "failed", exit_code=1, log_tail=tail[-50:]), joined)
    assert resp.status_code == 200
    failing.refresh_from_db()
    assert failing.reason == "OSError: [Errno 98] Address already in use"
    assert failing.output_tail.endswith("engine: line 39\nOSError: [Errno 98] Address already in use")
