"""Factories for inventory rows and wire payloads (no mocks: real rows, real messages)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
from django.db import connection

import llmgw_wire as wire
from inventory.nodes import upsert_node
from placement import agent_sync
from placement.models import Shard

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559, "compute_capability": "9.0"}


def gpu_payload(index: int, **overrides: Any) -> dict[str, Any]:
    """One GPU as an agent reports it."""
    g = {"index": index, "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000", **H100, "numa_node": index // 4}
    g.update(overrides)
    return g


def register_payload(node_id: str = "node-a", *, gpus: int | list[dict] = 8, **overrides: Any) -> dict[str, Any]:
    """A registration as an agent sends it; `gpus` is a count of H100s or the GPU payloads themselves."""
    p: dict[str, Any] = {
        "node_id": node_id,
        "hostname": f"{node_id}.cluster",
        "mgmt_addr": "127.0.0.1",
        "agent_version": "1.0.0",
        "memory_total_mb": 2_000_000,
        "cpu_count": 224,
        "gpus": [gpu_payload(i) for i in range(gpus)] if isinstance(gpus, int) else gpus,
        "fabrics": [],
    }
    p.update(overrides)
    return p


def make_node(node_id: str = "node-a", *, now: dt.datetime, gpus: int | list[dict] = 8, **overrides: Any):
    """Register a node through the same path an agent's registration takes."""
    node, _ = upsert_node(wire.Register.model_validate(register_payload(node_id, gpus=gpus, **overrides)), now=now)
    return node


def report_shard_state(shard_id: Any, state: str, *, now: dt.datetime, reason: str = "") -> None:
    """A heartbeat from the shard's node reporting it in `state`: the path production runs."""
    shard = Shard.objects.get(id=shard_id)
    status = wire.ShardStatus(shard_id=str(shard.id), replica_id=str(shard.replica_id), state=state, reason=reason)
    agent_sync.record_shard_states(shard.node_id, [status], now=now)


def other_session() -> psycopg.Connection:
    """A second database session, as another worker process has (its advisory locks are its own)."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)
