"""Telemetry as a heartbeat leaves it in the cache: IB ports and GPU sensors (real wire shapes)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import llmgw_wire as wire
from inventory import telemetry

SM_A = "0x0002c90300a1b2c1"
SM_B = "0x0002c90300a1b2c2"
SM_OTHER = "0x0002c90300ffff01"


def ib_port(hca: str = "mlx5_0", port: int = 1, **overrides: Any) -> dict[str, Any]:
    """One active 400 Gb/s InfiniBand port seeing SM_A, as telemetry holds it."""
    p = {
        "hca": hca,
        "port": port,
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate_gbps": 400,
        "link_layer": "InfiniBand",
        "counters": {},
        "node_guid": "0xa088c20300ab0000",
        "port_guid": "0xa088c20300ab0001",
        "sm_guid": SM_A,
        "tx_bps": 0.0,
        "rx_bps": 0.0,
    }
    p.update(overrides)
    return wire.IBPort.model_validate(p).model_dump(mode="json") | {"tx_bps": p["tx_bps"], "rx_bps": p["rx_bps"]}


def put(
    node_id: str,
    *,
    now: dt.datetime,
    ports: list[dict] | None = None,
    gpus: list[dict] | None = None,
    agent_at: float | None = None,
) -> dict[str, Any]:
    """Store a node's telemetry the way the heartbeat does."""
    at = now.timestamp()
    data = {
        "at": at,
        "agent_at": at if agent_at is None else agent_at,
        "load": None,
        "gpus": [wire.GPUSensor.model_validate(g).model_dump(mode="json") for g in gpus or []],
        "ib_ports": ports or [],
    }
    telemetry.put(node_id, data)
    return data
