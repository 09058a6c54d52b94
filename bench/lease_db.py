"""What a batch of leases costs PostgreSQL, with the node table as migrated and with last_seen indexed as it was.

A scratch database migrated as production is, BENCH_LEASE_DB_NODES (10,000)
nodes with a credential each, rows as wide as a registered node's (labels,
features, engine versions). The batched endpoint's own statement
(inventory/lease.py renew_batch) renews BENCH_LEASE_DB_BATCH (10) random
nodes at a time, BENCH_LEASE_DB_LEASES (30,000) leases in all; the CPU
(user + system) of the PostgreSQL backend that ran them, from /proc, over
the leases. Then the same with the table as it was before it left room for
heap-only updates (an index on last_seen, the default fillfactor, the table
rewritten), alternating, BENCH_LEASE_DB_RUNS (3) runs of each, min / median /
max with the share of heap-only updates; and the liveness sweep's kind of
query (a count of the ready nodes silent past a cutoff) on each, the price
of going without the index.
"""

from __future__ import annotations

import os
import random
import statistics
import time

from bench.common import scratch_database


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _populate(n: int) -> dict[str, str]:
    """n nodes with a credential each; their credential hashes by node."""
    from django.utils import timezone

    from agents import credentials
    from agents.models import NodeCredential
    from inventory.models import Node

    now = timezone.now()
    Node.objects.bulk_create(
        [
            Node(
                id=f"node-{i:05d}",
                hostname=f"node-{i:05d}.cluster.example",
                mgmt_addr=f"127.{100 + i // 65536}.{i // 256 % 256}.{i % 256}",
                state="ready",
                last_seen=now,
                agent_version="0.9.0",
                features=["lease", "status_gate", "wakeup", "ports"],
                agent_labels={"rack": f"r{i // 18}", "pool": "default", "zone": "a"},
                engine_versions={"vllm": "0.11.0", "sglang": "0.5.2", "llama.cpp": "b6000"},
            )
            for i in range(n)
        ],
        batch_size=2000,
    )
    hashes = {f"node-{i:05d}": credentials.hash_secret(f"llmgw-node-bench-{i}") for i in range(n)}
    NodeCredential.objects.bulk_create(
        [NodeCredential(node_id=k, token_hash=v, issued_at=now) for k, v in hashes.items()], batch_size=2000
    )
    return hashes


def _leases(hashes: dict[str, str], *, total: int, size: int, seed: int) -> tuple[float, float]:
    """CPU ms of this connection's backend per lease, and the share of heap-only updates, over `total` leases."""
    from django.db import connection
    from django.utils import timezone

    from agents.lease import TABLES
    from inventory import lease

    rng = random.Random(seed)
    ids = list(hashes)
    with connection.cursor() as c:
        c.execute("SELECT pg_backend_pid()")
        pid = c.fetchone()[0]
        c.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'inventory_node'")
        upd0, hot0 = c.fetchone()
    start = _ticks(pid)
    for _ in range(total // size):
        batch = rng.sample(ids, size)
        lease.renew_batch(TABLES, [lease.Ask(node_id=n, token_hash=hashes[n]) for n in batch], now=timezone.now())
    spent = _ticks(pid) - start
    # The cumulative statistics are flushed by the backend at most once a second when idle.
    time.sleep(1.2)
    with connection.cursor() as c:
        c.execute("SELECT pg_stat_force_next_flush()")
        c.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'inventory_node'")
        upd1, hot1 = c.fetchone()
    hz = os.sysconf("SC_CLK_TCK")
    return spent / hz * 1e3 / total, (hot1 - hot0) / max(1, upd1 - upd0)


def _sweep_query_ms() -> float:
    from django.db import connection

    with connection.cursor() as c:
        started = time.perf_counter()
        for _ in range(20):
            c.execute(
                "SELECT count(*) FROM inventory_node WHERE state = 'ready' AND last_seen < now() - interval '10 s'"
            )
            c.fetchone()
    return (time.perf_counter() - started) / 20 * 1e3


def _as_it_was(on: bool) -> None:
    """The node table as migrated (off), or with last_seen indexed and no room left on its pages (on)."""
    from django.db import connection

    with connection.cursor() as c:
        if on:
            c.execute("CREATE INDEX bench_node_last_seen ON inventory_node (last_seen)")
            c.execute("ALTER TABLE inventory_node RESET (fillfactor)")
        else:
            c.execute("DROP INDEX IF EXISTS bench_node_last_seen")
            c.execute("ALTER TABLE inventory_node SET (fillfactor = 70)")
        # Rewritten, so that every page is filled as the setting says.
        c.execute("VACUUM FULL ANALYZE inventory_node")


def run() -> list[str]:
    """The figures, one line per way of keeping the table."""
    import django

    django.setup()
    from django.db import connection

    if connection.vendor != "postgresql":
        return ["lease_db: PostgreSQL only (set DATABASE_URL)"]
    n = _env("BENCH_LEASE_DB_NODES", 10000)
    size = _env("BENCH_LEASE_DB_BATCH", 10)
    total = _env("BENCH_LEASE_DB_LEASES", 30000)
    runs = _env("BENCH_LEASE_DB_RUNS", 3)
    out = [f"{n:,} nodes, batches of {size}, {total:,} leases a run, {runs} runs each, alternating"]
    with scratch_database("lease_db"):
        hashes = _populate(n)
        got: dict[bool, list[tuple[float, float, float, float]]] = {False: [], True: []}
        for k in range(runs):
            for indexed in (True, False):
                _as_it_was(indexed)
                cpu, hot = _leases(hashes, total=total, size=size, seed=k)
                got[indexed].append((cpu, hot, _sweep_query_ms(), os.getloadavg()[0]))
    for indexed, label in ((True, "last_seen indexed, no room (before)"), (False, "as migrated (heap-only)")):
        rows = got[indexed]
        cpu = [r[0] for r in rows]
        out.append(
            f"{label}: PostgreSQL CPU a lease {min(cpu):.4f} / {statistics.median(cpu):.4f} / {max(cpu):.4f} ms; "
            f"heap-only updates {', '.join(f'{r[1]:.0%}' for r in rows)}; a sweep's count query "
            f"{', '.join(f'{r[2]:.2f}' for r in rows)} ms; load {', '.join(f'{r[3]:.1f}' for r in rows)}"
        )
    return out
