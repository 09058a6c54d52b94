"""The agent protocol against the real server over HTTP: join, heartbeat, commands, refusal, liveness, fencing."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from django.utils import timezone

import llmgw_wire as wire
from inventory import liveness, outbox
from inventory.models import Node, NodeState
from placement.models import Shard
from tests.agents.conftest import JOIN, heartbeat_payload, make_shard
from tests.factories import register_payload

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_agent_conversation_over_http(live_server, settings):
    settings.LLMGW_JOIN_TOKEN = JOIN
    base = f"{live_server.url}/api/v1/agent"
    with httpx.Client(base_url=base, timeout=10) as http:
        # Join: the join token buys a credential.
        assert http.post("/register", json=register_payload("node-a")).status_code == 401
        resp = http.post("/register", json=register_payload("node-a"), headers={"Authorization": f"Bearer {JOIN}"})
        assert resp.status_code == 200
        cred = resp.json()["credential"]
        auth = {"Authorization": f"Bearer {cred}"}
        other = http.post("/register", json=register_payload("node-b"), headers={"Authorization": f"Bearer {JOIN}"})
        assert other.status_code == 200

        # Credential refusal: wrong secret, another node, a join token taking over.
        assert (
            http.post("/heartbeat", json=heartbeat_payload(), headers={"Authorization": "Bearer x"}).status_code == 401
        )
        assert http.post("/heartbeat", json=heartbeat_payload("node-b"), headers=auth).status_code == 403
        take_over = http.post("/register", json=register_payload("node-a"), headers={"Authorization": f"Bearer {JOIN}"})
        assert take_over.status_code == 403

        # A command is delivered until acknowledged, never after.
        cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="vllm", version="0.11.0"), now=timezone.now())
        for _ in range(2):
            got = http.post("/heartbeat", json=heartbeat_payload(), headers=auth).json()["commands"]
            assert [c["id"] for c in got] == [str(cmd.id)]
        acked = http.post("/heartbeat", json=heartbeat_payload(acks=[str(cmd.id)]), headers=auth).json()
        assert acked["commands"] == []
        assert http.post("/heartbeat", json=heartbeat_payload(), headers=auth).json()["commands"] == []

        # Shard states from heartbeats.
        shard = make_shard("node-a", now=timezone.now(), state="starting")
        state = {"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": "ready"}
        assert http.post("/heartbeat", json=heartbeat_payload(shards=[state]), headers=auth).status_code == 200
        assert Shard.objects.get(id=shard.id).state == "ready"

        # Liveness: silence makes the node unreachable, then lost, and its shard failed.
        # (The sweep runs steadily, as beat runs it: a gap between sweeps is not held against a node.)
        silent_since = Node.objects.get(id="node-a").last_seen
        for t in range(0, 31, 10):
            liveness.sweep(now=silent_since + dt.timedelta(seconds=t))
        liveness.sweep(now=silent_since + dt.timedelta(seconds=31))
        assert Node.objects.get(id="node-a").state == NodeState.UNREACHABLE
        for t in range(41, 301, 10):
            liveness.sweep(now=silent_since + dt.timedelta(seconds=t))
        # The other node, silent longer, goes first: one lost node a sweep in a fleet of two.
        liveness.sweep(now=silent_since + dt.timedelta(seconds=301))
        liveness.sweep(now=silent_since + dt.timedelta(seconds=311))
        assert Node.objects.get(id="node-a").state == NodeState.LOST
        assert Shard.objects.get(id=shard.id).state == "failed"

        # The node comes back with its old shard still running: it is fenced, not adopted.
        running = {"replica_id": str(shard.replica_id), "shard_id": str(shard.id), "state": "ready"}
        back = http.post("/register", json=register_payload("node-a", running_shards=[running]), headers=auth).json()
        assert back["adopted"] == []
        assert [(c["kind"], c["shard_id"]) for c in back["commands"]] == [("stop_shard", str(shard.id))]
        assert Node.objects.get(id="node-a").state == NodeState.READY
        stop_id = back["commands"][0]["id"]
        # Until acknowledged, the heartbeat keeps delivering it.
        again = http.post("/heartbeat", json=heartbeat_payload(), headers=auth).json()["commands"]
        assert [c["id"] for c in again] == [stop_id]
        assert http.post("/heartbeat", json=heartbeat_payload(acks=[stop_id]), headers=auth).json()["commands"] == []

        # A live shard is adopted as it runs.
        live = make_shard("node-a", now=timezone.now(), state="ready")
        running = {"replica_id": str(live.replica_id), "shard_id": str(live.id), "state": "ready"}
        adopted = http.post("/register", json=register_payload("node-a", running_shards=[running]), headers=auth).json()
        assert adopted["adopted"] == [str(live.id)] and adopted["commands"] == []
