"""Whether one node can take one shard of a request, and which of its cards it would get.

The planner asks these of every node it considers, and every node not chosen
keeps the first reason it failed on, so "why is this replica pending?" has an
answer node by node. Pure: no database and no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from llmgw_wire import engines as wire_engines
from placement.snapshot import CORE_W, GPUInfo, NodeInfo, Snapshot

if TYPE_CHECKING:
    from placement.planner import ReplicaRequest

# Engines the agent carries itself: always installed.
BUILTIN_ENGINES = frozenset(e.name for e in wire_engines.ENGINES.values() if e.builtin)


def shard_power(req: ReplicaRequest, gpus: Iterable[GPUInfo]) -> float:
    """A shard's draw for power budgets: declared, or its cards plus its cores."""
    if req.power_w:
        return req.power_w
    return sum(g.power_w() for g in gpus) + req.cpu_cores * CORE_W


def _kw(w: float) -> str:
    s = f"{w / 1000:.1f}"
    return s[:-2] if s.endswith(".0") else s


def power_reason(
    snap: Snapshot, n: NodeInfo, watts: float, extra: Mapping[tuple[str, str], float] | None = None
) -> str:
    """Why adding `watts` on this node breaks a budget, "" when it does not."""
    for bk in snap.budget_keys_of(n):
        budget = snap.budgets[bk]
        would = snap.budget_used.get(bk, 0.0) + (extra or {}).get(bk, 0.0) + watts
        if would > budget + 1e-9:
            return f"power budget {bk[0]}={bk[1]} would reach {_kw(would)} of {_kw(budget)} kW"
    return ""


def node_reason(req: ReplicaRequest, n: NodeInfo, snap: Snapshot, *, need: int | None = None) -> str:
    """Why this node cannot take one shard of the request, "" when it can (power aside)."""
    if n.state != "ready":
        return n.state
    if n.silent_s:
        return f"no heartbeat for {n.silent_s} s: lease expired" if n.silent_s < 10**9 else "never heard from"
    if n.held:
        return n.held
    if n.id in req.avoid:
        return req.avoid[n.id]
    for k, v in req.selector.items():
        have = n.labels.get(k)
        if have is None:
            return f"no label {k}, needs {k}={v}"
        if have != v:
            return f"label {k}={have}, needs {k}={v}"
    need = req.gpus_per_node if need is None else need
    if req.gpu_class and need and req.gpu_class not in n.gpu_classes():
        have = ", ".join(sorted(c for c in n.gpu_classes() if c)) or "none"
        return f"no {req.gpu_class} GPUs (has {have})"
    free = n.free_count(req.gpu_class)
    if free < need:
        return f"{free} free GPU{'' if free == 1 else 's'}, needs {need}"
    if req.memory_gb and n.memory_total_gb:
        avail = n.memory_total_gb - n.memory_claimed_gb
        if avail < req.memory_gb:
            return f"needs {req.memory_gb} GB host memory, {max(avail, 0)} free"
    if req.cpu_cores and n.cpu_count:
        avail = n.cpu_count - n.cpu_claimed
        if avail < req.cpu_cores:
            return f"needs {req.cpu_cores} CPU cores, {max(avail, 0)} free"
    present = n.weights is not None and req.model_path in n.weights
    if req.model_path.startswith("/") and n.weights is not None and not present:
        return f"weights {req.model_path} not present"
    if req.disk_gb and not present and n.disk_known:
        avail_gb = n.disk_free_bytes // 10**9
        if avail_gb < req.disk_gb:
            return f"needs {req.disk_gb} GB local disk for weights, {avail_gb} free"
    if must_install(req, n):
        blocked = n.engines_blocked.get(wire_engines.canonical(req.engine) or req.engine)
        if blocked:
            return blocked
    return ""


def must_install(req: ReplicaRequest, n: NodeInfo) -> bool:
    """Whether the node lacks the engine and has said which it has (an old agent cannot say)."""
    # Both sides by canonical name: a node reporting `llama-server` has the `llamacpp` a profile asks for.
    engine = wire_engines.canonical(req.engine) or req.engine
    return engine not in BUILTIN_ENGINES and n.engines_probed and engine not in n.engines


def choose_gpus(n: NodeInfo, need: int, *, gpu_class: str = "", hcas: Iterable[str] = ()) -> tuple[int, ...]:
    """Pick `need` free cards: one NUMA node if one can hold them, NVLink peers, nearest the adapters.

    A NUMA node that fits exactly is preferred to a bigger one, so the bigger
    one stays whole for a later, larger shard.
    """
    free = n.free_gpus(gpu_class)
    if need <= 0:
        return ()
    if need >= len(free):
        return tuple(sorted(g.index for g in free))[:need]
    hcas = tuple(hcas) or tuple(h for f in n.fabrics for h in f.hcas)
    by_numa: dict[int, list[GPUInfo]] = {}
    for g in free:
        by_numa.setdefault(g.numa, []).append(g)
    fitting = [grp for numa, grp in by_numa.items() if numa >= 0 and len(grp) >= need]
    if fitting:
        pool = min(fitting, key=lambda grp: (len(grp), -max(g.hca_rank(hcas) for g in grp), grp[0].numa))
    else:
        pool = free
    chosen: list[GPUInfo] = []
    numa_counts: Counter[int] = Counter()
    rest = list(pool)
    while len(chosen) < need:
        picked = {g.index for g in chosen}
        left = {g.index for g in rest}
        best = max(
            rest,
            key=lambda g, picked=picked, left=left: (
                len(g.nvlink_peers & picked),
                numa_counts[g.numa] if g.numa >= 0 else 0,
                g.hca_rank(hcas),
                len(g.nvlink_peers & left),
                -g.index,
            ),
        )
        chosen.append(best)
        numa_counts[best.numa] += 1
        rest.remove(best)
    return tuple(sorted(g.index for g in chosen))
