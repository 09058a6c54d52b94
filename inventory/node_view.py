"""A node as its admin page shows it: the durable inventory joined with the live telemetry.

Plain functions, so the page's content is tested without a browser and the
list, the node page and the API agree on what a "problem" is.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import llmgw_wire as wire
from inventory import gpus as gpu_rules
from inventory import scans, telemetry
from inventory.models import GPU, Node

# `nvidia-smi topo -m` distances, nearest first.
TOPO_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")


def nearest_adapters(nic_paths: Mapping[str, str]) -> list[str]:
    """The HCAs closest to a card on the PCIe tree (ties all listed), [] when unknown.

    A shard's traffic should leave through the adapter under its own PCIe
    switch; one across the socket link halves what NCCL gets.
    """
    ranked = [(TOPO_ORDER.index(p.upper()), hca) for hca, p in nic_paths.items() if p.upper() in TOPO_ORDER]
    if not ranked:
        return []
    best = min(r for r, _ in ranked)
    return sorted(hca for r, hca in ranked if r == best)


@dataclass
class GPURow:
    """One card with its live sensors (None: not in the cache)."""

    gpu: GPU
    memory_used_mb: float | None
    util_percent: float | None
    temp_c: float | None
    power_w: float | None
    power_limit_w: float | None
    healthy: bool
    problems: list[str]
    wear: list[str]
    nearest: list[str]
    # Which shard holds the card ("" free).
    holder: str = ""

    @property
    def memory(self) -> str:
        """Used and total memory, always in the same form: "2 / 189471 MiB", "- / 189471 MiB" unread."""
        used = "-" if self.memory_used_mb is None else f"{self.memory_used_mb:.0f}"
        total = f"{self.gpu.memory_total_mb}" if self.gpu.memory_total_mb else "?"
        return f"{used} / {total} MiB"


def gpu_holders(allocations: Iterable[Any], shards: Iterable[Any]) -> dict[int, str]:
    """Card index -> the shard holding it, as an operator reads it ("llama-70b rank 0 · 78907165 (ready)").

    `allocations` carry `shard_id` and `gpu_indices`; `shards` are the node's
    shards with their replica and deployment. A claim whose shard is gone
    from the list (its record pruned) still says which shard id holds it.
    """
    by_id = {str(s.id): s for s in shards}
    out: dict[int, str] = {}
    for a in allocations:
        s = by_id.get(str(a.shard_id))
        if s is None:
            label = f"shard {str(a.shard_id)[:8]}"
        else:
            label = f"{s.replica.deployment.name} rank {s.rank} · {str(s.replica_id)[:8]} ({s.state})"
        for i in a.gpu_indices:
            out[i] = label
    return out


def _sensors(data: Mapping[str, Any] | None) -> dict[int, wire.GPUSensor]:
    out = {}
    for raw in (data or {}).get("gpus") or []:
        try:
            s = wire.GPUSensor.model_validate(raw)
        except ValueError:
            continue
        out[s.index] = s
    return out


def gpu_rows(gpus: list[GPU], data: Mapping[str, Any] | None, holders: Mapping[int, str] | None = None) -> list[GPURow]:
    """The GPU table: inventory row, live sensors, health and wear problems, and who holds each card."""
    sensors = _sensors(data)
    rows = []
    for g in gpus:
        s = sensors.get(g.index)
        problems = list(g.problems)
        if g.ecc_errors:
            problems.insert(0, f"{g.ecc_errors} uncorrected ECC errors")
        if s is not None:
            problems += [p for p in s.problems if p not in problems]
        rows.append(
            GPURow(
                gpu=g,
                memory_used_mb=s.memory_used_mb if s and s.memory_used_mb else None,
                util_percent=s.util_percent if s and s.util_percent >= 0 else None,
                temp_c=s.temp_c if s and s.temp_c else None,
                power_w=s.power_w if s and s.power_w else None,
                power_limit_w=s.power_limit_w if s and s.power_limit_w else None,
                # A hardware XID in the wear column is never beside "healthy",
                # whatever an older agent put in its problems.
                healthy=g.healthy and not (s and s.problems) and not gpu_rules.hardware_xid(s.wear if s else None),
                problems=problems,
                wear=gpu_rules.wear_problems(s.wear if s else None),
                nearest=nearest_adapters(g.nic_paths),
                holder=(holders or {}).get(g.index, ""),
            )
        )
    return rows


def topology_reported(gpus: list[GPU]) -> bool:
    """Whether the agent sent the node's GPU topology (`nvidia-smi topo -m`): NVLink peers or adapter paths.

    Without it an empty NVLink matrix means "not reported", not "no NVLink".
    """
    return any(g.nvlink_peers or g.nic_paths for g in gpus)


def nvlink_matrix(gpus: list[GPU]) -> list[tuple[int, list[str]]]:
    """The GPU-by-GPU NVLink matrix: "X" on the diagonal, "NV" where a card lists the other as a peer."""
    indices = [g.index for g in gpus]
    out = []
    for g in gpus:
        peers = set(g.nvlink_peers)
        out.append((g.index, ["X" if j == g.index else ("NV" if j in peers else "") for j in indices]))
    return out


@dataclass
class PortLive:
    """An IB port with its live rates."""

    hca: str
    port: int
    state: str
    phys_state: str
    rate_gbps: int
    link_layer: str
    sm_guid: str
    network: str
    tx_bps: float
    rx_bps: float


def ib_ports(data: Mapping[str, Any] | None) -> list[PortLive]:
    """The node's IB/RoCE ports from the telemetry cache, with tx/rx in bits per second."""
    out = [
        PortLive(
            p.hca,
            p.port,
            p.state,
            p.phys_state,
            p.rate_gbps,
            p.link_layer,
            p.sm_guid,
            p.network,
            float(raw.get("tx_bps") or 0),
            float(raw.get("rx_bps") or 0),
        )
        for raw, p in scans.validated_ports(data)
    ]
    return sorted(out, key=lambda p: (p.hca, p.port))


def node_problems(node: Node, data: Mapping[str, Any] | None, *, gpus: list[GPU] | None = None) -> list[str]:
    """Everything wrong with a node, a sentence each: the list's problems count and the page's banner."""
    gpus = list(node.gpus.all()) if gpus is None else gpus
    out: list[str] = []
    if not node.reachable:
        out.append(f"heartbeats missing since {node.unreachable_since or node.last_seen or 'registration'}")
    for row in gpu_rows(gpus, data):
        out += [f"GPU {row.gpu.index}: {p}" for p in row.problems + row.wear]
    reported = [g for g in gpus if gpu_rules.fabric_reported(g.fabric_state)]
    if reported and not node.nvlink_domain:
        joined = [g for g in reported if g.nvlink_domain]
        if joined:
            out.append(f"NVLink: {len(joined)} of {len(gpus)} cards joined")
    if node.nvlink_domain and not gpu_rules.imex_up(node.imex_state):
        out.append(f"IMEX down ({node.imex_state or 'not reported'})")
    return out


def age(then: dt.datetime | None, now: dt.datetime) -> str:
    """How long ago, in the largest unit that reads well ("12s", "5m", "3h", "2d"); "never" for None."""
    if then is None:
        return "never"
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def rate(bps: float) -> str:
    """A link rate in bits per second, as a person reads it."""
    for unit, scale in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} b/s"


@dataclass
class NodePage:
    """What the node page shows besides the model's own fields."""

    gpus: list[GPURow]
    matrix: list[tuple[int, list[str]]]
    matrix_header: list[int]
    topology_reported: bool
    ports: list[PortLive]
    problems: list[str]
    telemetry_at: float | None
    has_telemetry: bool
    load: dict[str, Any] = field(default_factory=dict)


def node_page(node: Node, *, holders: Mapping[int, str] | None = None) -> NodePage:
    """Gather the node page's tables from the inventory and the telemetry cache (`holders`: see gpu_holders)."""
    data = telemetry.get(node.id)
    gpus = list(node.gpus.all())
    return NodePage(
        gpus=gpu_rows(gpus, data, holders),
        matrix=nvlink_matrix(gpus),
        matrix_header=[g.index for g in gpus],
        topology_reported=topology_reported(gpus),
        ports=ib_ports(data),
        problems=node_problems(node, data, gpus=gpus),
        telemetry_at=(data or {}).get("at"),
        has_telemetry=data is not None,
        load=(data or {}).get("load") or {},
    )


@dataclass
class CredentialBox:
    """The node's own credential as its page shows it: whether it has one and its history.

    The secret is never shown (only its hash is kept). There is no per-use
    timestamp on a credential: a heartbeat is authenticated with it, so the
    node's last heartbeat is when it was last used.
    """

    present: bool
    issued_at: dt.datetime | None = None
    issued_by: str = ""
    rotation_requested_at: dt.datetime | None = None
    rotation_pending: bool = False
    last_used: dt.datetime | None = None


# Who says what a node's credential is: the app that issues credentials
# (agents registers it in its AppConfig.ready); inventory knows no credential table.
_credential_source: Callable[[Node], CredentialBox] | None = None


def register_credential_source(source: Callable[[Node], CredentialBox]) -> None:
    """Name the function that describes a node's credential for its page (one per process)."""
    global _credential_source
    _credential_source = source


def credential_box(node: Node) -> CredentialBox:
    """What the node page's Credential box says about `node`'s credential; none when no app issues credentials."""
    if _credential_source is None:
        return CredentialBox(present=False)
    return _credential_source(node)
