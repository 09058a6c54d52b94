"""Reading the cluster from the database into a planning snapshot.

The snapshot itself (placement.snapshot) is pure data and knows no database,
so the planner, its benchmarks and its tests run without one; this module is
the one place that reads the tables it is built from, with a constant number
of queries whatever the size of the cluster.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

from django.conf import settings
from django.db.models import Q, Sum

from inventory import fabric as fabric_rules
from inventory import gpus as gpu_rules
from inventory import resources, scans, telemetry
from inventory.models import (
    GPU,
    AllocatedGPU,
    Allocation,
    EngineInstall,
    FabricAttachment,
    LocalWeights,
    Node,
    Storage,
)
from placement.models import Hold, PowerBudget, ReplicaState, Shard
from placement.snapshot import FabricInfo, GPUInfo, HoldInfo, NodeInfo, Snapshot
from wire import shard_states


def build(*, unique_ports: bool | None = None, now: dt.datetime | None = None) -> Snapshot:
    """Read the cluster into a snapshot with a constant number of queries.

    One query per table (nodes, GPUs, fabrics, storage, weights, engine
    installs, allocations, held GPUs, live shards' ports, holds, budgets) and
    one cache round trip for telemetry, whatever the number of nodes. With
    `now`, a node whose last heartbeat is older than LLMGW_UNREACHABLE_AFTER
    is refused whatever its state says (the sweep may not have run yet);
    callers that place (the reconciler, the dry run) always pass it.
    """
    unique = settings.LLMGW_SHARD_PORTS_UNIQUE if unique_ports is None else unique_ports
    nodes = list(
        Node.objects.values_list(
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
    lease = settings.LLMGW_UNREACHABLE_AFTER
    ids = [r[0] for r in nodes]
    tele = telemetry.get_many(ids)

    gpus: dict[str, list[tuple]] = defaultdict(list)
    for row in GPU.objects.values_list(
        "node_id",
        "index",
        "gpu_class",
        "ecc_errors",
        "problems",
        "numa_node",
        "nvlink_peers",
        "nic_paths",
        "fabric_health",
    ).order_by("node_id", "index"):
        gpus[row[0]].append(row)
    held_gpus: dict[str, set[int]] = defaultdict(set)
    for node_id, idx in AllocatedGPU.objects.values_list("node_id", "gpu_index"):
        held_gpus[node_id].add(idx)
    claims = {
        r["node_id"]: r
        for r in Allocation.objects.values("node_id").annotate(
            mem=Sum("memory_gb"), cpu=Sum("cpu_cores"), power=Sum("power_w")
        )
    }
    fabrics: dict[str, list[tuple]] = defaultdict(list)
    for row in FabricAttachment.objects.values_list("node_id", "name", "hcas", "rate_gbps"):
        fabrics[row[0]].append(row)
    storage: dict[str, list[Any]] = defaultdict(list)
    for row in Storage.objects.values_list("node_id", "shared", "free_bytes", "total_bytes", named=True):
        storage[row.node_id].append(row)
    weights: dict[str, set[str]] = defaultdict(set)
    for node_id, path in LocalWeights.objects.values_list("node_id", "path"):
        weights[node_id].add(path)
    installs: dict[str, dict[str, str]] = defaultdict(dict)
    installed: dict[str, set[str]] = defaultdict(set)
    for node_id, engine, state, detail in EngineInstall.objects.values_list("node_id", "engine", "state", "detail"):
        if state == "ready":
            installed[node_id].add(engine)
        elif state in ("unsupported", "failed"):
            installs[node_id][engine] = f"engine {engine} {state}" + (f": {detail}" if detail else "")
    ports: dict[str, set[int]] = defaultdict(set)
    live = ~Q(replica__state__in=[ReplicaState.STOPPED, ReplicaState.FAILED]) | ~Q(state__in=shard_states.TERMINAL)
    for node_id, port in Shard.objects.filter(live).values_list("node_id", "http_port"):
        ports[node_id].add(port)
    holds = [
        HoldInfo(scope=h[0], node_id=h[1] or "", label_key=h[2], label_value=h[3], fabric=h[4])
        for h in Hold.objects.values_list("scope", "node_id", "label_key", "label_value", "fabric")
    ]
    budgets = {(k, v): w for k, v, w in PowerBudget.objects.values_list("label_key", "label_value", "budget_w")}

    # One canonical subnet-manager map over every port the cluster reports,
    # so a fabric keeps one key through a failover.
    all_ports = {i: scans.ports_of(tele.get(i)) for i in ids}
    canon = fabric_rules.canonical_sms(p for ps in all_ports.values() for p in ps)

    out: dict[str, NodeInfo] = {}
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
        silence = 0.0 if now is None else (now - last_seen).total_seconds() if last_seen else float("inf")
        t = tele.get(node_id) or {}
        limits = {s.get("index"): float(s.get("power_limit_w") or 0) for s in t.get("gpus") or []}
        ginfo = []
        sick = [
            f"GPU {row[1]} fabric health {row[8]}"
            for row in gpus.get(node_id, [])
            if gpu_rules.fabric_unhealthy(row[8])
        ]
        for _, idx, cls, ecc, problems, numa, peers, nic, _health in gpus.get(node_id, []):
            ginfo.append(
                GPUInfo(
                    index=idx,
                    gpu_class=cls,
                    healthy=gpu_rules.healthy(ecc, problems),
                    numa=numa,
                    nvlink_peers=frozenset(peers or []),
                    nic_paths=dict(nic or {}),
                    power_limit_w=limits.get(idx, 0.0),
                )
            )
        finfo = []
        for _, name, hcas, rate in fabrics.get(node_id, []):
            pf = fabric_rules.physical_fabric(hcas, all_ports[node_id], canon)
            finfo.append(FabricInfo(name, tuple(hcas), rate, pf.key, pf.known, pf.consistent, pf.keys))
        labels = dict(labels or {})
        held = next((h.text() for h in holds if h.matches(node_id, labels, finfo)), "")
        c = claims.get(node_id) or {}
        load = t.get("load") or {}
        draw = sum(float(s.get("power_w") or 0) for s in t.get("gpus") or []) + float(load.get("cpu_power_w") or 0)
        free = frozenset(resources.free_gpu_indices(ginfo, held_gpus.get(node_id, ())))
        disk_free, disk_total = resources.local_disk(storage.get(node_id, ()))
        found = weights.get(node_id, set())
        out[node_id] = NodeInfo(
            id=node_id,
            state=state,
            mgmt_addr=mgmt,
            labels=labels,
            held=held,
            gpus=tuple(ginfo),
            free=free,
            memory_total_gb=(mem_mb or 0) // 1024,
            memory_claimed_gb=c.get("mem") or 0,
            cpu_count=cpus or 0,
            cpu_claimed=c.get("cpu") or 0,
            disk_free_bytes=disk_free,
            # Both zero is unknown, not a full disk.
            disk_known=storage_rep and (disk_free, disk_total) != (0, 0),
            weights=frozenset(found) if resources.knows_its_weights(weights_rep) else None,
            engines=frozenset(engine_versions or {}) | installed.get(node_id, set()),
            engines_probed=probed,
            engines_blocked=installs.get(node_id, {}),
            nvlink_domain=domain,
            nvlink_out="; ".join(sick),
            imex_up=gpu_rules.imex_up(imex),
            fabrics=tuple(finfo),
            power_draw_w=draw,
            ports=frozenset(ports.get(node_id, ())),
            silent_s=(int(min(silence, 10**9)) or 1) if silence > lease else 0,
        )
    snap = Snapshot(
        nodes=out,
        budgets=budgets,
        port_base=settings.LLMGW_SHARD_PORT_BASE,
        cluster_ports={p for ps in ports.values() for p in ps} if unique else None,
    )
    if budgets:
        for node_id, n in out.items():
            power = (claims.get(node_id) or {}).get("power")
            if power:
                snap.claim_power(n, power)
    return snap
