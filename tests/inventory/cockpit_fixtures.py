"""Builders for the cockpit's tests: a small NVLink cluster, shards on nodes, telemetry."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

from inventory import telemetry
from llmgw_agent.discovery import nvidia_smi
from llmgw_agent.discovery.readings import to_gpu
from placement.models import Deployment, EngineProfile, Replica, Shard
from tests.factories import gpu_payload, make_node

CLUSTER = "a1b2c3d4-0000-4000-8000-00000000c0de"
HARDWARE = Path(__file__).resolve().parent.parent / "fixtures" / "hardware"
GB200 = {"name": "NVIDIA GB200", "memory_total_mb": 189471, "compute_capability": "10.0"}


def card(index: int, *, joined: bool = True, bandwidth: str = "Full", cluster: str = CLUSTER, clique: str = "7"):
    """A GB200 card's payload: joined to `cluster`, or still joining."""
    fabric = (
        {
            "state": "Completed",
            "status": "Success",
            "cluster_uuid": cluster,
            "clique_id": clique,
            "bandwidth": bandwidth,
        }
        if joined
        else {"state": "In Progress", "status": "N/A", "cluster_uuid": cluster, "clique_id": clique, "bandwidth": ""}
    )
    return gpu_payload(
        index,
        uuid=f"GPU-{index:04d}-tray-{cluster[:4]}-{clique}-{bandwidth}-{joined}",
        **GB200,
        fabric=fabric,
        nvlink_peers=[j for j in range(4) if j != index],
        nic_paths={"mlx5_0": "PIX" if index < 2 else "SYS", "mlx5_1": "SYS" if index < 2 else "PIX"},
        numa_node=index // 2,
    )


def tray(node_id: str, *, now: dt.datetime, joined=(True, True, True, True), bandwidth="Full", imex="UP", **kw):
    """A GB200 tray: four cards, each joined or not, IMEX state and one channel."""
    gpus = [card(i, joined=j, bandwidth=bandwidth if i == 1 else "Full") for i, j in enumerate(joined)]
    return make_node(node_id, now=now, gpus=gpus, imex={"state": imex, "channels": 1}, **kw)


def nvlink_cluster(now: dt.datetime):
    """One joined tray, one half-joined tray, one with degraded bandwidth."""
    return (
        tray("tray-joined", now=now),
        tray("tray-half", now=now, joined=(True, True, False, False)),
        tray("tray-degraded", now=now, bandwidth="Degraded (50%)"),
    )


def replica_on(node_id: str, *, now: dt.datetime, deployment: str = "llama", state: str = "ready", gpus=(0, 1)):
    """A replica with one shard on `node_id`, in shard state `state`."""
    profile, _ = EngineProfile.objects.get_or_create(name="tp2", defaults={"engine": "vllm", "tp": 2})
    dep, _ = Deployment.objects.get_or_create(name=deployment, defaults={"served_model": "m", "profile": profile})
    replica = Replica.objects.create(id=uuid.uuid4(), deployment=dep, state="ready", created_at=now, updated_at=now)
    Shard.objects.create(
        replica=replica,
        node_id=node_id,
        rank=0,
        gpu_indices=list(gpus),
        # Each live shard on a node has a port of its own (a database constraint).
        http_port=8000 + Shard.objects.filter(node_id=node_id).count(),
        state=state,
        created_at=now,
        updated_at=now,
    )
    return replica


def ib_port(hca: str, *, sm: str, sms=(), state="ACTIVE", rate=400, tx=0.0, rx=0.0, port=1):
    """An IB port as the telemetry cache holds it."""
    return {
        "hca": hca,
        "port": port,
        "state": state,
        "rate_gbps": rate,
        "link_layer": "InfiniBand",
        "sm_guid": sm,
        "sms": [{"guid": g, "state": s} for g, s in sms],
        "tx_bps": tx,
        "rx_bps": rx,
    }


def put_telemetry(node_id: str, *, ports=(), gpus=(), at: float = 0.0):
    """Store a node's telemetry the way a heartbeat does."""
    telemetry.put(node_id, {"at": at, "agent_at": None, "load": None, "gpus": list(gpus), "ib_ports": list(ports)})


def recorded_cards(name: str) -> list[dict]:
    """The cards of a recorded `nvidia-smi -q` (tests/fixtures/hardware/nvidia-smi-q/), as the agent registers them."""
    text = (HARDWARE / "nvidia-smi-q" / name).read_text()
    return [to_gpu(r).model_dump(mode="json") for r in nvidia_smi.parse_query(text).gpus]
