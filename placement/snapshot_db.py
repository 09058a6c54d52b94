"""Reading nodes into planner records: for every node (a full build) or for a few (a kept index's reload).

The same per-table queries serve both, filtered by node id for a reload, so a
node reloaded alone is the record a full build would make of it. What needs
parsing (telemetry's ports, GPU rows, the fabric attachments) is read into a
node's `NodeFacts` once, when the node is loaded; what depends on the whole
cluster or on the moment (the canonical subnet-manager map, holds, the lease)
is applied on top by `node_info`, which is cheap, so a kept index can redo it
for every node when one of those changes without reading anything again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.db.models import Q, Sum

from inventory import fabric as fabric_rules
from inventory import gpus as gpu_rules
from inventory import resources, scans, telemetry
from inventory.models import GPU, AllocatedGPU, Allocation, EngineInstall, FabricAttachment, LocalWeights, Node, Storage
from llmgw_wire import engines as wire_engines
from llmgw_wire import shard_states
from placement.models import Hold, PowerBudget, ReplicaState, Shard
from placement.snapshot import FabricInfo, GPUInfo, HoldInfo, NodeInfo, Snapshot

# (master subnet manager GUID, the managers the port lists): all the canonical map reads of a port.
SMPair = tuple[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One node as read and parsed: everything but what the cluster or the moment adds."""

    # The record with held "", silent_s 0 and fabrics unresolved (their keys need the canonical map).
    base: NodeInfo
    last_seen: dt.datetime | None
    # (declared name, adapters, rate) per fabric attachment.
    attachments: tuple[tuple[str, tuple[str, ...], int], ...]
    ports: tuple[Any, ...]
    sm_pairs: frozenset[SMPair]
    # Power claimed by the node's allocations (W), counted against budgets.
    power_claimed: float


def silent_s(last_seen: dt.datetime | None, *, now: dt.datetime | None, lease: float) -> int:
    """Seconds of silence past the lease (0: the lease holds; 10**9: never heard from)."""
    if now is None:
        return 0
    silence = (now - last_seen).total_seconds() if last_seen else float("inf")
    return (int(min(silence, 10**9)) or 1) if silence > lease else 0


def sm_pairs(ports: Iterable[Any]) -> frozenset[SMPair]:
    """What the canonical subnet-manager map reads of these ports."""
    return frozenset((p.sm_guid or "", tuple(sm.guid for sm in p.sms or [])) for p in ports)


def canon_of(pairs: Iterable[SMPair]) -> dict[str, str]:
    """The canonical subnet-manager map over the cluster's distinct pairs.

    Equal to fabric_rules.canonical_sms over every port: each component is
    named by its lowest GUID, whatever the order, and duplicates add nothing.
    """
    ports = [SimpleNamespace(sm_guid=master, sms=[SimpleNamespace(guid=g) for g in listed]) for master, listed in pairs]
    return fabric_rules.canonical_sms(ports)


def _by_node(ids: Collection[str] | None) -> Q:
    return Q() if ids is None else Q(node_id__in=list(ids))


def load(node_ids: Collection[str] | None = None) -> dict[str, NodeFacts]:
    """Read nodes (all when None) with one query per table and one cache round trip for telemetry.

    A node id asked for and not found is absent from the answer (forgotten).
    """
    f = _by_node(node_ids)
    node_q = Node.objects.all() if node_ids is None else Node.objects.filter(id__in=list(node_ids))
    nodes = list(
        node_q.values_list(
            "id",
            "state",
            "mgmt_addr",
            "labels",
            "memory_total_mb",
            "cpu_count",
            "engine_versions",
            "engines_probed",
            "imex_state",
            "nvlink_domain",
            "storage_reported",
            "weights_reported",
            "last_seen",
        )
    )
    if not nodes:
        return {}
    ids = [r[0] for r in nodes]
    tele = telemetry.get_many(ids)

    gpus: dict[str, list[tuple]] = defaultdict(list)
    for row in (
        GPU.objects.filter(f)
        .values_list(
            "node_id",
            "index",
            "gpu_class",
            "ecc_errors",
            "problems",
            "numa_node",
            "nvlink_peers",
            "nic_paths",
            "fabric_health",
        )
        .order_by("node_id", "index")
    ):
        gpus[row[0]].append(row)
    holdings = _Holdings(f)
    fabrics: dict[str, list[tuple]] = defaultdict(list)
    for row in FabricAttachment.objects.filter(f).values_list("node_id", "name", "hcas", "rate_gbps"):
        fabrics[row[0]].append(row)
    storage: dict[str, list[Any]] = defaultdict(list)
    for row in Storage.objects.filter(f).values_list("node_id", "shared", "free_bytes", "total_bytes", named=True):
        storage[row.node_id].append(row)
    weights: dict[str, set[str]] = defaultdict(set)
    for node_id, path in LocalWeights.objects.filter(f).values_list("node_id", "path"):
        weights[node_id].add(path)
    installs: dict[str, dict[str, str]] = defaultdict(dict)
    installed: dict[str, set[str]] = defaultdict(set)
    for node_id, engine, state, detail in EngineInstall.objects.filter(f).values_list(
        "node_id", "engine", "state", "detail"
    ):
        engine = wire_engines.canonical(engine) or engine
        if state == "ready":
            installed[node_id].add(engine)
        elif state in ("unsupported", "failed"):
            installs[node_id][engine] = f"engine {engine} {state}" + (f": {detail}" if detail else "")

    out: dict[str, NodeFacts] = {}
    for (
        node_id,
        state,
        mgmt,
        labels,
        mem_mb,
        cpus,
        engine_versions,
        probed,
        imex,
        domain,
        storage_rep,
        weights_rep,
        last_seen,
    ) in nodes:
        t = tele.get(node_id) or {}
        limits = {s.get("index"): float(s.get("power_limit_w") or 0) for s in t.get("gpus") or []}
        rows = gpus.get(node_id, [])
        sick = [f"GPU {row[1]} fabric health {row[8]}" for row in rows if gpu_rules.fabric_unhealthy(row[8])]
        ginfo = tuple(
            _gpu(idx, cls, ecc, problems, numa, peers, nic, limits.get(idx, 0.0))
            for _, idx, cls, ecc, problems, numa, peers, nic, _health in rows
        )
        held, power_claimed = holdings.of(node_id, ginfo)
        load_ = t.get("load") or {}
        draw = sum(float(s.get("power_w") or 0) for s in t.get("gpus") or []) + float(load_.get("cpu_power_w") or 0)
        disk_free, disk_total = resources.local_disk(storage.get(node_id, ()))
        found = weights.get(node_id, set())
        node_ports = tuple(scans.ports_of(t))
        out[node_id] = NodeFacts(
            base=NodeInfo(
                id=node_id,
                state=state,
                mgmt_addr=mgmt,
                labels=dict(labels or {}),
                gpus=ginfo,
                memory_total_gb=(mem_mb or 0) // 1024,
                cpu_count=cpus or 0,
                disk_free_bytes=disk_free,
                # Both zero is unknown, not a full disk.
                disk_known=storage_rep and (disk_free, disk_total) != (0, 0),
                weights=frozenset(found) if resources.knows_its_weights(weights_rep) else None,
                engines=frozenset(wire_engines.canonical_versions(engine_versions or {}))
                | installed.get(node_id, set()),
                engines_probed=probed,
                engines_blocked=installs.get(node_id, {}),
                nvlink_domain=domain,
                nvlink_out="; ".join(sick),
                imex_up=gpu_rules.imex_up(imex),
                power_draw_w=draw,
                busy_ports=listening(t),
                **held,
            ),
            last_seen=last_seen,
            attachments=tuple((name, tuple(hcas), rate) for _, name, hcas, rate in fabrics.get(node_id, [])),
            ports=node_ports,
            sm_pairs=sm_pairs(node_ports),
            power_claimed=power_claimed,
        )
    return out


class _Holdings:
    """What the nodes' shards hold, read in three queries: GPUs, the allocations' sums, the ports of live shards."""

    def __init__(self, f: Q) -> None:
        self.gpus: dict[str, set[int]] = defaultdict(set)
        for node_id, idx in AllocatedGPU.objects.filter(f).values_list("node_id", "gpu_index"):
            self.gpus[node_id].add(idx)
        self.claims = {
            r["node_id"]: r
            for r in Allocation.objects.filter(f)
            .values("node_id")
            .annotate(mem=Sum("memory_gb"), cpu=Sum("cpu_cores"), power=Sum("power_w"))
        }
        self.ports: dict[str, set[int]] = defaultdict(set)
        live = ~Q(replica__state__in=[ReplicaState.STOPPED, ReplicaState.FAILED]) | ~Q(state__in=shard_states.TERMINAL)
        for node_id, port, after, rendezvous in (
            Shard.objects.filter(f).filter(live).values_list("node_id", "http_port", "ports_after", "rendezvous_port")
        ):
            self.ports[node_id].update(range(port, port + 1 + after))
            if rendezvous:
                self.ports[node_id].add(rendezvous)

    def of(self, node_id: str, gpus: Iterable[GPUInfo]) -> tuple[dict[str, Any], float]:
        """A node's NodeInfo fields its holdings decide, and the power its allocations claim (W)."""
        c = self.claims.get(node_id) or {}
        fields = {
            "free": frozenset(resources.free_gpu_indices(gpus, self.gpus.get(node_id, ()))),
            "memory_claimed_gb": c.get("mem") or 0,
            "cpu_claimed": c.get("cpu") or 0,
            "ports": frozenset(self.ports.get(node_id, ())),
        }
        return fields, float(c.get("power") or 0)


def reload_holdings(facts: Mapping[str, NodeFacts]) -> dict[str, NodeFacts]:
    """These nodes' facts with what their shards hold read again (three queries), the rest kept.

    The same record `load` makes of a node whose holdings alone changed since
    `facts` were read (changes.mark(..., holdings=True)).
    """
    if not facts:
        return {}
    holdings = _Holdings(_by_node(facts))
    out: dict[str, NodeFacts] = {}
    for node_id, f in facts.items():
        held, power = holdings.of(node_id, f.base.gpus)
        out[node_id] = dataclasses.replace(f, base=dataclasses.replace(f.base, **held), power_claimed=power)
    return out


def listening(entry: Mapping[str, Any]) -> frozenset[int]:
    """The TCP ports a node's last status reports listening (none when not reported, or not numbers)."""
    found = entry.get("listening_ports") or ()
    return (
        frozenset(p for p in found if isinstance(p, int) and not isinstance(p, bool))
        if isinstance(found, list)
        else frozenset()
    )


def _gpu(idx: int, cls: str, ecc: Any, problems: Any, numa: int, peers: Any, nic: Any, limit: float) -> GPUInfo:
    return GPUInfo(
        index=idx,
        gpu_class=cls,
        healthy=gpu_rules.healthy(ecc, problems),
        numa=numa,
        nvlink_peers=frozenset(peers or []),
        nic_paths=dict(nic or {}),
        power_limit_w=limit,
    )


def holds_and_budgets() -> tuple[list[HoldInfo], dict[tuple[str, str], float]]:
    """The facility holds and the power budgets, one query each."""
    holds = [
        HoldInfo(scope=h[0], node_id=h[1] or "", label_key=h[2], label_value=h[3], fabric=h[4])
        for h in Hold.objects.values_list("scope", "node_id", "label_key", "label_value", "fabric")
    ]
    budgets = {(k, v): w for k, v, w in PowerBudget.objects.values_list("label_key", "label_value", "budget_w")}
    return holds, budgets


def node_info(
    facts: NodeFacts, *, canon: Mapping[str, str], holds: Iterable[HoldInfo], now: dt.datetime | None, lease: float
) -> NodeInfo:
    """A node's planner record: its facts with fabric keys under the cluster's map, its hold and its lease."""
    finfo = []
    for name, hcas, rate in facts.attachments:
        pf = fabric_rules.physical_fabric(hcas, facts.ports, canon)
        finfo.append(FabricInfo(name, hcas, rate, pf.key, pf.known, pf.consistent, pf.keys))
    n = facts.base
    held = next((h.text() for h in holds if h.matches(n.id, n.labels, finfo)), "")
    return dataclasses.replace(
        n, held=held, fabrics=tuple(finfo), silent_s=silent_s(facts.last_seen, now=now, lease=lease)
    )


def assemble(
    facts: Mapping[str, NodeFacts],
    holds: list[HoldInfo],
    budgets: dict[tuple[str, str], float],
    *,
    unique_ports: bool,
    now: dt.datetime | None,
    canon: Mapping[str, str] | None = None,
    cls: type[Snapshot] = Snapshot,
) -> Snapshot:
    """A snapshot of these nodes (their claimed power counted against the budgets).

    `canon`: the canonical subnet-manager map when the caller has it, else computed from these nodes.
    """
    if canon is None:
        canon = canon_of({p for f in facts.values() for p in f.sm_pairs})
    lease = settings.LLMGW_UNREACHABLE_AFTER
    out = {i: node_info(f, canon=canon, holds=holds, now=now, lease=lease) for i, f in facts.items()}
    snap = cls(
        nodes=out,
        budgets=budgets,
        port_base=settings.LLMGW_SHARD_PORT_BASE,
        cluster_ports={p for n in out.values() for p in n.ports} if unique_ports else None,
    )
    if budgets:
        for node_id, n in out.items():
            power = facts[node_id].power_claimed
            if power:
                snap.claim_power(n, power)
    return snap


def build(*, unique_ports: bool | None = None, now: dt.datetime | None = None) -> Snapshot:
    """Every node read into a snapshot with a constant number of queries (see snapshot.build)."""
    unique = settings.LLMGW_SHARD_PORTS_UNIQUE if unique_ports is None else unique_ports
    facts = load(None)
    holds, budgets = holds_and_budgets()
    return assemble(facts, holds, budgets, unique_ports=unique, now=now)
