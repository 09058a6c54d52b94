"""One reconcile pass over 1,000 deployments and 10,000 shards, in a throwaway database.

Target: under 2 s, with a number of SQL queries that does not grow with the
number of deployments (tests/placement/test_reconciler.py pins the same at
small scale). Also measured: a pass that places 1,000 new replicas, a
scale-up of 1,000 replicas into 5,000 empty nodes (target: 1,000 replicas/s
end to end, plan and write), written in batches and, for comparison, one
placement per transaction as before (placement/batch_writes.py), and one
deployment of 1,000 into 10,000 nodes in one pass and in four
(placement/reconciler.py BATCH_PER_PASS).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass

from bench.common import StatementCounter, scratch_database


def _populate(deployments: int, replicas_per: int, now) -> None:
    from inventory.models import AllocatedGPU, Allocation
    from placement.models import Deployment, EngineProfile, Replica, Shard

    shards = deployments * replicas_per
    nodes_needed = shards // 4 + deployments // 4 + 16
    _nodes("node", 0, nodes_needed, now)
    prof = EngineProfile.objects.create(name="bench", engine="echo", gpus_per_node=2)
    fp = prof.fingerprint()
    deps = Deployment.objects.bulk_create(
        [
            Deployment(name=f"dep-{d:04d}", served_model=f"m{d}", profile=prof, replicas=replicas_per)
            for d in range(deployments)
        ]
    )
    reps, shard_rows, allocs, held = [], [], [], []
    slot = 0
    for dep in deps:
        for _ in range(replicas_per):
            node = f"node-{slot // 4:05d}"
            gpus = [(slot % 4) * 2, (slot % 4) * 2 + 1]
            rid, sid = uuid.uuid4(), uuid.uuid4()
            reps.append(
                Replica(
                    id=rid,
                    deployment=dep,
                    state="ready",
                    profile_fp=fp,
                    endpoint=f"http://x:{18000 + slot % 4}",
                    created_at=now,
                    updated_at=now,
                    ready_at=now,
                )
            )
            shard_rows.append(
                Shard(
                    id=sid,
                    replica_id=rid,
                    node_id=node,
                    rank=0,
                    gpu_indices=gpus,
                    http_port=18000 + slot % 4,
                    state="ready",
                    profile_fp=fp,
                    created_at=now,
                    updated_at=now,
                )
            )
            allocs.append(Allocation(node_id=node, replica_id=rid, shard_id=sid))
            slot += 1
    Replica.objects.bulk_create(reps, batch_size=5000)
    Shard.objects.bulk_create(shard_rows, batch_size=5000)
    Allocation.objects.bulk_create(allocs, batch_size=5000)
    for a, s in zip(allocs, shard_rows, strict=True):
        held += [AllocatedGPU(allocation=a, node_id=s.node_id, gpu_index=g) for g in s.gpu_indices]
    AllocatedGPU.objects.bulk_create(held, batch_size=5000)


def _nodes(prefix: str, net: int, count: int, now) -> None:
    """`count` ready 8-card H100 nodes named <prefix>-00000..., managed at 127.<net>.x.y (loopback)."""
    from inventory.models import GPU, Node

    Node.objects.bulk_create(
        [
            Node(id=f"{prefix}-{i:05d}", mgmt_addr=f"127.{net}.{i // 256}.{i % 256}", state="ready", last_seen=now)
            for i in range(count)
        ],
        batch_size=2000,
    )
    GPU.objects.bulk_create(
        [
            GPU(node_id=f"{prefix}-{i:05d}", index=g, gpu_class="H100-80GB", numa_node=g // 4)
            for i in range(count)
            for g in range(8)
        ],
        batch_size=5000,
    )


def _empty_fleet(nodes: int, now) -> None:
    _nodes("big", 1, nodes, now)


@dataclass
class ScaleUp:
    """One scale-up pass: seconds of the pass and of its parts, statements, replicas placed."""

    took: float
    build: float
    write: float
    statements: int
    placed: int

    @property
    def plan(self) -> float:
        """The rest of the pass: planning, creating the replicas, reading the deployments."""
        return self.took - self.build - self.write


class _Timed:
    """Adds the seconds spent in a function to a total while it is patched in."""

    def __init__(self, fn) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - started


def _scale_up(replicas: int, *, batched: bool, now) -> ScaleUp:
    """A pass creating and placing `replicas` new replicas of ten new deployments (the others paused)."""
    from django.db import connection

    from placement import batch_writes, kept, placing, reconciler
    from placement.models import Deployment, EngineProfile

    Deployment.objects.update(paused=True)
    prof, _ = EngineProfile.objects.get_or_create(name="bench-2", engine="echo", gpus_per_node=2)
    first = Deployment.objects.count()
    for d in range(first, first + 10):
        Deployment.objects.create(name=f"up-{d}", served_model=f"up-{d}", profile=prof, replicas=replicas // 10)
    saved = (batch_writes.MIN_BATCH, kept.current, batch_writes.BatchWriter.flush, placing.write_placement)
    build, flush, single = _Timed(kept.current), _Timed(batch_writes.BatchWriter.flush), _Timed(saved[3])
    batch_writes.MIN_BATCH = saved[0] if batched else 10**9
    kept.current, placing.write_placement = build, single
    batch_writes.BatchWriter.flush = lambda self: flush(self)
    try:
        with StatementCounter(connection) as q:
            started = time.perf_counter()
            report = reconciler.reconcile(now=now)
            took = time.perf_counter() - started
    finally:
        batch_writes.MIN_BATCH, kept.current, batch_writes.BatchWriter.flush, placing.write_placement = saved
    return ScaleUp(took, build.total, flush.total + single.total, q.count, report.placed)


def _one_deployment(replicas: int, *, per_pass: int, now) -> tuple[float, list[float]]:
    """One new deployment of `replicas` single-card replicas, its passes back to back: (seconds, each pass's)."""
    from placement import reconciler
    from placement.models import Deployment, EngineProfile

    Deployment.objects.update(paused=True)
    prof, _ = EngineProfile.objects.get_or_create(name="bench-1", engine="echo", gpus_per_node=1)
    n = Deployment.objects.count()
    Deployment.objects.create(name=f"one-{n}", served_model=f"one-{n}", profile=prof, replicas=replicas)
    saved, reconciler.BATCH_PER_PASS = reconciler.BATCH_PER_PASS, per_pass
    passes: list[float] = []
    try:
        started = time.perf_counter()
        while True:
            began = time.perf_counter()
            more = reconciler.reconcile(now=now).more
            passes.append(time.perf_counter() - began)
            if not more:
                return time.perf_counter() - started, passes
    finally:
        reconciler.BATCH_PER_PASS = saved


def _spread(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in (min(values), statistics.median(values), max(values)))


def run() -> list[str]:
    import django

    django.setup()
    from django.db import connection
    from django.utils import timezone

    from placement import kept
    from placement.models import Deployment, Shard
    from placement.reconciler import reconcile

    # The kept index is the process's: each throwaway database starts from its own.
    kept.reset()
    with scratch_database("bench_reconcile"):
        now = timezone.now()
        _populate(1000, 10, now)
        shards = Shard.objects.count()
        reconcile(now=now)  # warm the code paths and the database's caches
        with StatementCounter(connection) as q1:
            started = time.perf_counter()
            report = reconcile(now=now)
            took = time.perf_counter() - started
        steady = (report.created, report.placed, report.stopped, report.failed)
        # Scale 1,000 deployments up by one replica each: a pass that places.
        Deployment.objects.update(replicas=11)
        with StatementCounter(connection) as q2:
            started = time.perf_counter()
            grown = reconcile(now=now)
            took2 = time.perf_counter() - started
    runs = int(os.environ.get("BENCH_SCALEUP_RUNS", "3"))
    kept.reset()
    with scratch_database("bench_scaleup"):
        now = timezone.now()
        _empty_fleet(5000, now)
        _scale_up(10, batched=True, now=now)  # warm
        batched = [_scale_up(1000, batched=True, now=now) for _ in range(runs)]
        single = _scale_up(1000, batched=False, now=now)
    kept.reset()
    # One deployment of 1,000 at 10,000 nodes, as the fleet benchmark scales up: in one pass at the
    # reconciler's bound, and in four at the old bound of 256.
    from placement.reconciler import BATCH_PER_PASS

    one: dict[int, list[tuple[float, list[float]]]] = {BATCH_PER_PASS: [], 256: []}
    with scratch_database("bench_scaleup_one"):
        now = timezone.now()
        _empty_fleet(10_000, now)
        _one_deployment(10, per_pass=BATCH_PER_PASS, now=now)  # warm
        for _ in range(runs):
            for per_pass, got in one.items():
                got.append(_one_deployment(1000, per_pass=per_pass, now=now))
    kept.reset()
    b = min(batched, key=lambda r: r.took)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return [
        f"steady pass over 1,000 deployments and {shards:,} shards: {took * 1000:.0f} ms, "
        f"{q1.count} SQL queries (target < 2 s; changes {steady})",
        f"scale-up pass placing {grown.placed:,} new replicas: {took2:.2f} s, {q2.count:,} statements "
        f"({q2.count / max(grown.placed, 1):.1f} per placement, savepoints included)",
        f"scale-up of 1,000 replicas into 5,000 empty nodes, batched, {runs} runs, min/median/max: "
        f"pass {_spread([r.took for r in batched])} s, the kept index brought up to date in it "
        f"{_spread([r.build for r in batched])} s, "
        f"writes {_spread([r.write for r in batched])} s, planning and the rest {_spread([r.plan for r in batched])} s",
        f"  best run: {b.placed / b.took:,.0f} replicas/s end to end (target 1,000), "
        f"{b.placed / (b.took - b.build):,.0f}/s without the index's update, "
        f"{b.placed / b.write:,.0f}/s written; {b.statements:,} statements",
        f"the same, one placement per transaction: pass {single.took:.2f} s ({single.placed / single.took:,.0f}/s), "
        f"index update {single.build:.2f} s, writes {single.write:.2f} s "
        f"({single.placed / single.write:,.0f}/s written), {single.statements:,} statements",
        *(
            f"one deployment of 1,000 single-card replicas into 10,000 empty nodes, at most {per_pass:,} a pass, "
            f"{runs} runs, min/median/max: {_spread([t for t, _ in got])} s in {len(got[0][1])} pass(es)"
            for per_pass, got in one.items()
        ),
        f"load average at the end: {load}",
    ]
