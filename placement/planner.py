"""Where a replica goes, or why nowhere: a pure function over a snapshot.

No database and no clock: the reconciler, the dry run and the benchmarks all
call `plan` on a Snapshot, and the same cluster always gives the same answer.
Every node not chosen gets a reason, so "why is this replica pending?" has an
answer node by node.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw_wire import engines as wire_engines
from placement.fit import choose_gpus, must_install, node_reason, power_reason, shard_power
from placement.snapshot import NodeInfo, Snapshot

if TYPE_CHECKING:
    from placement.models import EngineProfile

BINPACK = "binpack"
SPREAD = "spread"


@dataclass(frozen=True)
class ReplicaRequest:
    """What one replica needs of the cluster, per shard (one shard per node)."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_class: str = ""
    memory_gb: int = 0
    cpu_cores: int = 0
    # Declared draw per shard (W); 0 derives it from the node's cards and cores.
    power_w: float = 0.0
    engine: str = "echo"
    model_path: str = ""
    # Local disk a download of the weights needs (GB); 0 constrains nothing.
    disk_gb: int = 0
    selector: Mapping[str, str] = field(default_factory=dict)
    # Nodes this request keeps off, with why ("2 failed starts here in the last 30 min").
    avoid: Mapping[str, str] = field(default_factory=dict)
    # Ports the engine binds right after each shard's HTTP port (SGLang's data-parallel attention).
    ports_after: int = 0

    @classmethod
    def from_profile(
        cls,
        profile: EngineProfile,
        *,
        selector: Mapping[str, str] | None = None,
        avoid: Mapping[str, str] | None = None,
    ) -> ReplicaRequest:
        """The request of a profile.

        GPUs per node, when not declared, is the profile's TP x PP spread over
        its nodes; a profile of an engine that can run on cores alone
        (llama.cpp) declaring CPU cores and no GPUs is a CPU-only shard.
        """
        if profile.gpus_per_node:
            per_node = profile.gpus_per_node
        elif profile.cpu_cores and _runs_on_cores(profile.engine):
            per_node = 0
        else:
            per_node = max(1, math.ceil(profile.tp * profile.pp / max(profile.nodes, 1)))
        return cls(
            gpus_per_node=per_node,
            nodes=profile.nodes,
            gpu_class=profile.gpu_class,
            memory_gb=profile.memory_gb,
            cpu_cores=profile.cpu_cores,
            power_w=profile.power_w,
            engine=profile.engine,
            model_path=profile.model_path,
            disk_gb=profile.disk_gb,
            selector=dict(selector or {}),
            avoid=dict(avoid or {}),
            ports_after=_ports_after(profile.engine, profile.args or []),
        )


def _runs_on_cores(engine: str) -> bool:
    """Whether the engine can serve from CPU cores alone (not one rank per GPU): llama.cpp, echo."""
    canon = wire_engines.canonical(engine)
    return bool(canon) and not wire_engines.ENGINES[canon].rank_per_gpu


def _ports_after(engine: str, args: list[str]) -> int:
    """Ports the engine binds after its HTTP port with these args (0 for an engine no one knows)."""
    canon = wire_engines.canonical(engine)
    return wire_engines.ENGINES[canon].ports_after(args) if canon else 0


@dataclass(frozen=True)
class ShardPlan:
    """One shard's place: node, rank, cards, adapters, port and claims."""

    node_id: str
    rank: int
    gpu_indices: tuple[int, ...]
    hcas: tuple[str, ...] = ()
    http_port: int = 0
    # The rendezvous port on the rank-0 node of a multi-node replica.
    leader_port: int = 0
    # Ports bound right after http_port, reserved with it.
    ports_after: int = 0
    memory_gb: int = 0
    cpu_cores: int = 0
    power_w: float = 0.0
    install_engine: bool = False

    def ports(self) -> tuple[int, ...]:
        """Every port this shard binds: its HTTP port, those right after it, and the rendezvous port."""
        ports = tuple(range(self.http_port, self.http_port + 1 + self.ports_after))
        return ports + ((self.leader_port,) if self.leader_port else ())


@dataclass(frozen=True)
class Plan:
    """Where a replica goes."""

    shards: tuple[ShardPlan, ...]
    nvlink_domain: str = ""
    # Physical fabric key and the declared name it maps onto (multi-node over IB/RoCE).
    fabric: str = ""
    fabric_name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    # With explain: why each other node was not chosen.
    reasons: Mapping[str, str] = field(default_factory=dict)
    ok: bool = True

    @property
    def node_ids(self) -> list[str]:
        """The nodes, rank order."""
        return [s.node_id for s in self.shards]


@dataclass(frozen=True)
class NoPlace:
    """Why a replica cannot go anywhere now: a summary and a reason per node."""

    reason: str
    reasons: Mapping[str, str] = field(default_factory=dict)
    ok: bool = False


def _shard(
    req: ReplicaRequest,
    snap: Snapshot,
    n: NodeInfo,
    rank: int,
    need: int,
    hcas: tuple[str, ...],
    *,
    leader: bool,
) -> ShardPlan:
    idx = choose_gpus(n, need, gpu_class=req.gpu_class, hcas=hcas)
    cards = [g for g in n.gpus if g.index in idx]
    span = 1 + req.ports_after
    port = snap.free_port(n, span=span)
    return ShardPlan(
        node_id=n.id,
        rank=rank,
        gpu_indices=idx,
        hcas=hcas,
        http_port=port,
        leader_port=snap.free_port(n, skip=range(port, port + span)) if leader else 0,
        ports_after=req.ports_after,
        memory_gb=req.memory_gb,
        cpu_cores=req.cpu_cores,
        power_w=shard_power(req, cards),
        install_engine=must_install(req, n),
    )


def _fits(
    req: ReplicaRequest, snap: Snapshot, n: NodeInfo, extra: Mapping[tuple[str, str], float]
) -> tuple[str, float]:
    """Why the node cannot take one shard ("" when it can), and the shard's draw (0 under no budget)."""
    r = node_reason(req, n, snap)
    if r or not snap.budget_keys_of(n):
        return r, 0.0
    if req.power_w:
        watts = req.power_w
    else:
        idx = choose_gpus(n, req.gpus_per_node, gpu_class=req.gpu_class)
        watts = shard_power(req, [g for g in n.gpus if g.index in idx])
    return power_reason(snap, n, watts, extra), watts


def _pick(req: ReplicaRequest, snap: Snapshot, group: str, count: int, spread: bool) -> tuple[list[NodeInfo], int, str]:
    """The first `count` nodes of a group that fit, in policy order, and their free cards.

    Third, the first budget a node broke only with the shards chosen before
    it counted ("" if none): why a group of enough nodes may still refuse.
    """
    chosen: list[NodeInfo] = []
    extra: dict[tuple[str, str], float] = {}
    together = ""
    for n in snap.candidates(req.gpu_class, group, req.gpus_per_node, spread=spread):
        why, watts = _fits(req, snap, n, extra)
        if why:
            if watts and extra and not together and not power_reason(snap, n, watts):
                together = why
            continue
        chosen.append(n)
        if watts:
            for bk in snap.budget_keys_of(n):
                extra[bk] = extra.get(bk, 0.0) + watts
        if len(chosen) == count:
            break
    return chosen, sum(n.free_count(req.gpu_class) for n in chosen), together


def summarize(reasons: Mapping[str, str], *, limit: int = 4) -> str:
    """One line for a replica's reason: the commonest node reasons with their counts."""
    if not reasons:
        return "no nodes"
    counts = Counter(reasons.values()).most_common()
    parts = [
        f"{c} nodes: {r}" if c > 1 else f"{r} ({next(k for k, v in reasons.items() if v == r)})" for r, c in counts
    ]
    more = len(parts) - limit
    return "; ".join(parts[:limit]) + (f"; and {more} more" if more > 0 else "")


def plan(req: ReplicaRequest, snap: Snapshot, *, policy: str = BINPACK, explain: bool = False) -> Plan | NoPlace:
    """Find where a replica goes in the snapshot, or explain node by node why nowhere.

    Single node: the first node that fits in policy order (binpack: fewest free
    cards first; spread: most first; then node id). Several nodes: inside one
    NVLink domain first (every card joined, IMEX up; shards get
    NCCL_MNNVL_ENABLE=1), else on one physical InfiniBand/RoCE fabric, each
    shard given only that fabric's adapters. Nodes with no fabric never host
    a multi-node replica. The plan is not reserved: call snap.reserve(plan).
    """
    spread = policy == SPREAD
    if req.nodes <= 1:
        chosen, _, _ = _pick(req, snap, "", 1, spread)
        if not chosen:
            return _no_place(req, snap, policy)
        n = chosen[0]
        result = Plan(shards=(_shard(req, snap, n, 0, req.gpus_per_node, (), leader=False),))
        return _explained(result, req, snap, policy) if explain else result

    best: tuple | None = None
    for prefix in ("nvl:", "fab:"):
        for group in snap.groups(prefix):
            nodes, free, _ = _pick(req, snap, group, req.nodes, spread)
            if len(nodes) < req.nodes:
                continue
            score = (-free if spread else free, group)
            if best is None or score < best[0]:
                best = (score, group, nodes)
        if best is not None:
            break
    if best is None:
        return _no_place(req, snap, policy)
    _, group, nodes = best
    shards = []
    if group.startswith("nvl:"):
        for rank, n in enumerate(nodes):
            shards.append(_shard(req, snap, n, rank, req.gpus_per_node, (), leader=rank == 0))
        result = Plan(shards=tuple(shards), nvlink_domain=group[4:], env={"NCCL_MNNVL_ENABLE": "1"})
    else:
        key = group[4:]
        name = ""
        for rank, n in enumerate(nodes):
            f = n.fabric_for(key)
            assert f is not None
            name = name or f.name
            shards.append(_shard(req, snap, n, rank, req.gpus_per_node, f.hcas, leader=rank == 0))
        result = Plan(shards=tuple(shards), fabric=key, fabric_name=name)
    return _explained(result, req, snap, policy) if explain else result


def _multi_reason(req: ReplicaRequest, n: NodeInfo, groups: Mapping[str, str]) -> str:
    """Why a node that could take a shard is not part of a multi-node replica.

    `groups` says, per index group, how many usable nodes it has and what
    keeps enough of them from taking the replica together.
    """
    parts = []
    if n.nvlink_out:
        parts.append(f"out of NVLink: {n.nvlink_out}")
    if n.nvlink_domain and not n.imex_up:
        parts.append(f"NVLink domain {n.nvlink_domain}: IMEX down")
    elif n.domain_ready():
        parts.append(f"NVLink domain {n.nvlink_domain} {groups['nvl:' + n.nvlink_domain]}")
    if not n.fabrics:
        parts.append("no fabric: never hosts a multi-node replica")
    for f in n.fabrics:
        problem = f.problem()
        if problem:
            parts.append(problem)
        else:
            parts.append(f"physical fabric {f.key} {groups['fab:' + f.key]}")
    return "; ".join(parts) + f"; needs {req.nodes}"


def _reasons(req: ReplicaRequest, snap: Snapshot, placed: Plan | None = None, policy: str = "") -> dict[str, str]:
    skipped = set(placed.node_ids) if placed else set()
    reasons: dict[str, str] = {}
    fit: list[NodeInfo] = []
    for n in snap.nodes.values():
        if n.id in skipped:
            continue
        r, _ = _fits(req, snap, n, {})
        if r:
            reasons[n.id] = r
        else:
            fit.append(n)
    group = ""
    if placed is not None and req.nodes > 1:
        group = f"nvl:{placed.nvlink_domain}" if placed.nvlink_domain else f"fab:{placed.fabric}"
    usable: Counter[str] = Counter()
    # Only a replica over several nodes is kept off a node by its groups: at 10,000 nodes
    # counting them for a one-node replica took a third of the explanation.
    for n in fit if req.nodes > 1 else ():
        for g in n.groups()[1:]:
            usable[g] += 1
    said: dict[str, str] = {}
    for g, count in usable.items():
        said[g] = f"has {count} usable nodes"
        if count >= req.nodes > 1 and g != group:
            # Enough nodes, each fitting alone: their draw together may break a budget.
            together = _pick(req, snap, g, req.nodes, policy == SPREAD)[2]
            if together:
                said[g] += f", but not together ({together} with the replica's other shards)"
            elif placed is not None:
                said[g] += f"; {policy} chose {', '.join(placed.node_ids)}"
    chose = f"fits; {policy} chose {', '.join(placed.node_ids)}" if placed is not None else ""
    for n in fit:
        if placed is not None and (req.nodes <= 1 or group in n.groups()):
            reasons[n.id] = chose
        elif req.nodes > 1:
            reasons[n.id] = _multi_reason(req, n, said)
        else:
            reasons[n.id] = "fits"
    return dict(sorted(reasons.items()))


def _no_place(req: ReplicaRequest, snap: Snapshot, policy: str) -> NoPlace:
    reasons = _reasons(req, snap, policy=policy)
    return NoPlace(reason=summarize(reasons), reasons=reasons)


def _explained(result: Plan, req: ReplicaRequest, snap: Snapshot, policy: str) -> Plan:
    return dataclasses.replace(result, reasons=_reasons(req, snap, result, policy))
