"""Fixtures for the agent protocol: a joined node with its credential, shards to adopt."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

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
        http_port=8000 + rank,
        state=state,
        created_at=now,
        updated_at=now,
    )


def heartbeat_payload(node_id: str = "node-a", *, at: float | None = None, counters: int = 0, **extra) -> dict:
    """A realistic heartbeat: 8 GPUs with sensors and wear, 8 IB ports with counters."""
    wear = {
        "pcie_replays": 0,
        "retired_pages_sbe": -1,
        "retired_pages_dbe": -1,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "nvlink_crc_errors": 0,
        "nvlink_replay_errors": 0,
        "nvlink_recovery_errors": 0,
        "xid_errors": 0,
    }
    gpus = [
        {
            "index": i,
            "temp_c": 54.0 + i,
            "memory_temp_c": 60.0,
            "power_w": 402.5,
            "power_limit_w": 700.0,
            "util_percent": 93.0,
            "mem_util_percent": 41.0,
            "memory_used_mb": 71234.0,
            "memory_total_mb": 81559.0,
            "sm_clock_mhz": 1980.0,
            "wear": wear,
        }
        for i in range(8)
    ]
    ports = [
        {
            "hca": f"mlx5_{i}",
            "port": 1,
            "state": "4: ACTIVE",
            "phys_state": "5: LinkUp",
            "rate_gbps": 400,
            "link_layer": "InfiniBand",
            "counters": {
                "port_xmit_data": counters,
                "port_rcv_data": 2 * counters,
                "symbol_error": 0,
                "link_downed": 0,
            },
            "sm_guid": "0xa088c20300b3c4d0",
            "sm_lid": 1,
        }
        for i in range(8)
    ]
    p = {
        "node_id": node_id,
        "at": at,
        "load": {"cpu_percent": 35.5, "cpu_count": 224, "load1": 12.0, "mem_used_bytes": 2**40},
        "gpus": gpus,
        "ib_ports": ports,
        "shards": [],
        "acks": [],
    }
    p.update(extra)
    return p
