"""The planner on synthetic clusters: no database, the same code the reconciler runs.

- 10,000 single-node replicas (4 GPUs each) into 5,000 nodes of 8 GPUs,
  each plan reserved before the next (target: 700 replicas/s or more; the
  Kubernetes scheduler's own bar is about 680 pods/s at 5,000 nodes);
- one two-node replica in a 10,000-node cluster, half full, of NVLink
  domains and InfiniBand fabrics (target: under 20 ms).
"""

from __future__ import annotations

import statistics
import time

from placement.planner import Plan, ReplicaRequest, plan
from placement.snapshot import FabricInfo, GPUInfo, NodeInfo, Snapshot

CLASS = "H100-80GB"


def _gpus(n: int, cls: str = CLASS) -> tuple[GPUInfo, ...]:
    out = []
    for i in range(n):
        numa = i // (n // 2 or 1)
        peers = frozenset(j for j in range(n) if j != i)
        nic = {f"mlx5_{k}": ("PIX" if k == i // 2 else ("NODE" if k // 2 == numa else "SYS")) for k in range(n // 2)}
        out.append(GPUInfo(index=i, gpu_class=cls, numa=numa, nvlink_peers=peers, nic_paths=nic))
    return tuple(out)


def cluster(nodes: int, *, gpus: int = 8, domain_size: int = 0, fabrics: int = 4, cls: str = CLASS) -> Snapshot:
    """A synthetic cluster: racks of 18 nodes labelled, some NVLink domains, a few IB fabrics."""
    cards = _gpus(gpus, cls)
    out = {}
    for i in range(nodes):
        key = f"sm:0x{(i % fabrics) + 1:016x}"
        fab = FabricInfo("ib0", tuple(f"mlx5_{k}" for k in range(gpus // 2)), 400, key, True, True, (key,))
        nid = f"node-{i:05d}"
        out[nid] = NodeInfo(
            id=nid,
            mgmt_addr=f"127.{i // 65536}.{(i // 256) % 256}.{i % 256}",
            labels={"rack": f"r{i // 18}", "pool": "default"},
            gpus=cards,
            free=frozenset(range(gpus)),
            memory_total_gb=2048,
            cpu_count=224,
            nvlink_domain=f"cluster-{i // domain_size}/0" if domain_size else "",
            imex_up=bool(domain_size),
            fabrics=(fab,),
            engines=frozenset({"vllm"}),
            engines_probed=True,
        )
    return Snapshot(nodes=out)


def bench_single(nodes: int = 5000, replicas: int = 10_000) -> tuple[float, int]:
    snap = cluster(nodes)
    req = ReplicaRequest(gpus_per_node=4, gpu_class=CLASS, memory_gb=64, engine="vllm", selector={"pool": "default"})
    placed = 0
    started = time.perf_counter()
    for _ in range(replicas):
        p = plan(req, snap, policy="binpack")
        if isinstance(p, Plan):
            snap.reserve(p)
            placed += 1
    return time.perf_counter() - started, placed


def bench_two_node(nodes: int = 10_000, runs: int = 20) -> tuple[float, float, str]:
    snap = cluster(nodes, gpus=4, domain_size=18, cls="GB200-186GB")
    # Half the cluster busy: every other node has only two cards free.
    single = ReplicaRequest(gpus_per_node=2, gpu_class="GB200-186GB")
    for i, n in enumerate(list(snap.nodes.values())):
        if i % 2 == 0:
            snap.reserve(
                Plan(shards=(plan(single, Snapshot(nodes={n.id: n})).shards[0],))  # type: ignore[union-attr]
            )
    req = ReplicaRequest(gpus_per_node=4, nodes=2, gpu_class="GB200-186GB")
    times = []
    result = None
    for _ in range(runs):
        started = time.perf_counter()
        result = plan(req, snap, policy="binpack")
        times.append(time.perf_counter() - started)
    where = result.nvlink_domain if isinstance(result, Plan) else "nowhere"
    return statistics.median(times), max(times), where


def run() -> list[str]:
    build_started = time.perf_counter()
    cluster(5000)
    build_s = time.perf_counter() - build_started
    took, placed = bench_single()
    med, worst, where = bench_two_node()
    return [
        f"single-node: {placed} replicas into 5,000 nodes in {took:.2f} s = {placed / took:,.0f} replicas/s "
        f"(target >= 700; synthetic snapshot built in {build_s:.2f} s)",
        f"two-node: one replica in a 10,000-node cluster (half full): median {med * 1000:.2f} ms, "
        f"worst {worst * 1000:.2f} ms over 20 runs (target < 20 ms), placed in {where}",
    ]
