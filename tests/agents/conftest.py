"""Fixtures for the agent protocol: a joined node with its credential, shards to adopt."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from bench.heartbeat import heartbeat_payload as heartbeat_payload  # the tests' heartbeat, and the benchmark's
from placement.models import Deployment, EngineProfile, Replica, Shard
from tests.factories import register_payload

JOIN = "bootstrap-join-token-for-tests"


def post(client, path: str, body: Any, token: str | None, **extra):
    """POST a JSON body to an agent endpoint as an agent would."""
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(f"/api/v1/agent/{path}", data=data, content_type="application/json", **headers, **extra)


@pytest.fixture
def join_token(settings) -> str:
    settings.LLMGW_JOIN_TOKEN = JOIN
    return JOIN


@pytest.fixture
def joined(client, join_token, db):
    """Register node-a (8 GPUs) with the bootstrap token; returns its credential."""
    resp = post(client, "register", register_payload("node-a"), join_token)
    assert resp.status_code == 200, resp.content
    return resp.json()["credential"]


def make_shard(
    node_id: str,
    *,
    now: dt.datetime,
    state: str = "ready",
    replica_state: str = "ready",
    rank: int = 0,
    replica: Replica | None = None,
    gpus: list[int] | None = None,
) -> Shard:
    """A shard of a (new, unless given) replica placed on a node."""
    if replica is None:
        profile, _ = EngineProfile.objects.get_or_create(name="echo-1", defaults={"engine": "echo"})
        dep, _ = Deployment.objects.get_or_create(name="chat", defaults={"served_model": "chat", "profile": profile})
        replica = Replica.objects.create(deployment=dep, state=replica_state, created_at=now, updated_at=now)
    return Shard.objects.create(
        replica=replica,
        node_id=node_id,
        rank=rank,
        gpu_indices=gpus or [0],
        # Each live shard on a node has a port of its own (a database constraint).
        http_port=8000 + Shard.objects.filter(node_id=node_id).count(),
        state=state,
        created_at=now,
        updated_at=now,
    )
