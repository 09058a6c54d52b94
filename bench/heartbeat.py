"""Heartbeats per second against the real stack: gunicorn, PostgreSQL, Redis.

Creates a fresh database (<test database>_bench), migrates it, starts gunicorn
on a free loopback port, registers NODES 8-GPU nodes over HTTP (timing each
registration), gives each node 4 running shards, then drives realistic
heartbeats (8 GPUs with sensors and wear, 8 IB ports with counters, 4 shards)
from several load-generator processes, each holding persistent connections,
for a bounded time. Reports sustained heartbeats/s and latency percentiles.

The load generator runs on the same cores as the server, so the figure is
what the server gets while sharing the machine with its own clients.

Knobs (environment): BENCH_HB_NODES (default 500), BENCH_HB_SECONDS (10),
BENCH_HB_WORKERS (gunicorn processes, 3), BENCH_HB_THREADS (threads per
gunicorn process, 2), BENCH_HB_CLIENTS (load processes, 2),
BENCH_HB_CONCURRENCY (connections per load process, 4).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_database_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "llmgw"
    return urlunsplit(parts._replace(path=f"/{name}_bench"))


def _recreate_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def _server_env(db_url: str, join: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DATABASE_URL": db_url,
            "DATABASE_CONN_MAX_AGE": "600",
            "SECRET_KEY": secrets.token_urlsafe(32),
            "DEBUG": "0",
            "LLMGW_JOIN_TOKEN": join,
            "CELERY_BROKER_URL": "memory://",
            "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw") + "-bench",
            "LOG_LEVEL": "WARNING",
        }
    )
    return env


def register_payload(node_id: str, running: list[dict] | None = None) -> dict:
    """An 8-GPU H100 node's registration."""
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{node_id}-{i}",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mb": 81559,
            "compute_capability": "9.0",
            "numa_node": i // 4,
            "pci_bus_id": f"0000:{i + 0x18:02x}:00.0",
            "nvlink_peers": [j for j in range(8) if j != i],
            "nic_paths": {f"mlx5_{j}": "PIX" if j == i else "SYS" for j in range(8)},
            "fabric": {"state": "Completed", "status": "Success", "cluster_uuid": "0" * 32, "clique_id": "0"},
        }
        for i in range(8)
    ]
    return {
        "node_id": node_id,
        "hostname": f"{node_id}.cluster",
        "mgmt_addr": "10.0.0.1",
        "agent_version": "1.0.0",
        "labels": {"rack": "r1", "zone": "a"},
        "engines_probed": True,
        "engine_versions": {"vllm": "0.11.0"},
        "memory_total_mb": 2_000_000,
        "cpu_count": 224,
        "host": {"os_id": "ubuntu", "os_version": "24.04", "arch": "x86_64", "nvidia_driver": "570.86"},
        "gpus": gpus,
        "storage": [{"path": "/models", "free_bytes": 10**12, "total_bytes": 2 * 10**12}],
        "fabrics": [{"name": "ib0", "hcas": [f"mlx5_{j}" for j in range(8)], "rate_gbps": 400}],
        "imex": {"state": "UP", "channels": 2048},
        "running_shards": running or [],
    }


def heartbeat_payload(node_id: str, shards: list[str], tick: int) -> dict:
    """A realistic heartbeat: 8 GPUs with sensors and wear, 8 IB ports with counters, 4 shards."""
    wear = {
        "pcie_replays": 0,
        "retired_pages_sbe": -1,
        "retired_pages_dbe": -1,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "nvlink_crc_errors": 0,
        "nvlink_replay_errors": 0,
        "nvlink_recovery_errors": 0,
        "xid_errors": 0,
    }
    return {
        "node_id": node_id,
        "at": 1_800_000_000.0 + 5 * tick,
        "load": {"cpu_percent": 35.5, "cpu_count": 224, "load1": 12.0, "mem_used_bytes": 2**40},
        "gpus": [
            {
                "index": i,
                "temp_c": 60.0,
                "power_w": 450.0,
                "power_limit_w": 700.0,
                "util_percent": 95.0,
                "memory_used_mb": 70000.0,
                "memory_total_mb": 81559.0,
                "sm_clock_mhz": 1980.0,
                "wear": wear,
            }
            for i in range(8)
        ],
        "ib_ports": [
            {
                "hca": f"mlx5_{i}",
                "port": 1,
                "state": "4: ACTIVE",
                "rate_gbps": 400,
                "link_layer": "InfiniBand",
                "sm_guid": "0xa088c20300b3c4d0",
                "counters": {
                    "port_xmit_data": 10**9 * tick,
                    "port_rcv_data": 2 * 10**9 * tick,
                    "symbol_error": 0,
                    "link_downed": 0,
                    "port_rcv_errors": 0,
                },
            }
            for i in range(8)
        ],
        "shards": [{"shard_id": s, "state": "ready"} for s in shards],
        "imex": {"state": "UP", "channels": 2048},
        "acks": [],
    }


_MAKE_SHARDS = """
import json, sys, django
django.setup()
from django.utils import timezone
from placement.models import Deployment, EngineProfile, Replica, Shard
now = timezone.now()
nodes = json.load(sys.stdin)
profile = EngineProfile.objects.create(name="bench", engine="echo")
dep = Deployment.objects.create(name="bench", served_model="bench", profile=profile, replicas=len(nodes) * 4)
replicas = Replica.objects.bulk_create(
    [Replica(deployment=dep, state="ready", created_at=now, updated_at=now) for _ in range(len(nodes) * 4)]
)
shards = [
    Shard(replica=replicas[i * 4 + k], node_id=n, rank=0, gpu_indices=[2 * k, 2 * k + 1], http_port=8000 + k,
          state="ready", created_at=now, updated_at=now)
    for i, n in enumerate(nodes) for k in range(4)
]
Shard.objects.bulk_create(shards)
out = {}
for s in shards:
    out.setdefault(s.node_id, []).append(str(s.id))
json.dump(out, sys.stdout)
"""


def _load(url: str, nodes: list[tuple[str, str, list[str]]], seconds: float, concurrency: int, q) -> None:
    """One load-generator process: `concurrency` threads, each with its own persistent connection."""
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker(k: int) -> None:
        mine = nodes[k::concurrency]
        local: list[float] = []
        bad = 0
        with httpx.Client(base_url=url, timeout=10) as http:
            tick = 1
            while time.perf_counter() < deadline:
                for node_id, cred, shards in mine:
                    if time.perf_counter() >= deadline:
                        break
                    body = json.dumps(heartbeat_payload(node_id, shards, tick))
                    t0 = time.perf_counter()
                    r = http.post(
                        "/api/v1/agent/heartbeat",
                        content=body,
                        headers={"Authorization": f"Bearer {cred}", "Content-Type": "application/json"},
                    )
                    local.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        bad += 1
                tick += 1
        with lock:
            lat.extend(local)
            errors[0] += bad

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put((lat, errors[0]))


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run() -> list[str]:
    n_nodes = _env_int("BENCH_HB_NODES", 500)
    seconds = float(os.environ.get("BENCH_HB_SECONDS", 10))
    workers = _env_int("BENCH_HB_WORKERS", 3)
    threads = _env_int("BENCH_HB_THREADS", 2)
    clients = _env_int("BENCH_HB_CLIENTS", 2)
    concurrency = _env_int("BENCH_HB_CONCURRENCY", 4)

    db_url = _bench_database_url()
    _recreate_database(db_url)
    join = secrets.token_urlsafe(24)
    env = _server_env(db_url, join)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    port = _free_port()
    gunicorn = [
        sys.executable, "-m", "gunicorn", "llmgw.wsgi:application",
        "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--threads", str(threads),
        "--worker-class", "gthread", "--keep-alive", "30", "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(gunicorn, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            for _ in range(200):
                try:
                    http.get("/metrics")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            # Registration of an 8-GPU node, one at a time.
            creds: dict[str, str] = {}
            reg_times = []
            ids = [f"bench-{i:05d}" for i in range(n_nodes)]
            for node_id in ids:
                t0 = time.perf_counter()
                r = http.post("/api/v1/agent/register", json=register_payload(node_id),
                              headers={"Authorization": f"Bearer {join}"})  # fmt: skip
                reg_times.append(time.perf_counter() - t0)
                r.raise_for_status()
                creds[node_id] = r.json()["credential"]
            made = subprocess.run(
                [sys.executable, "-c", _MAKE_SHARDS], cwd=ROOT, env=env, input=json.dumps(ids),
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            shards = json.loads(made.stdout)
            # Re-registration with the node's credential, adopting 4 running shards.
            rereg = []
            for node_id in ids[: min(100, n_nodes)]:
                running = [{"replica_id": str(uuid.uuid4()), "shard_id": s, "state": "ready"} for s in shards[node_id]]
                t0 = time.perf_counter()
                r = http.post("/api/v1/agent/register", json=register_payload(node_id, running),
                              headers={"Authorization": f"Bearer {creds[node_id]}"})  # fmt: skip
                rereg.append(time.perf_counter() - t0)
                r.raise_for_status()
        nodes = [(n, creds[n], shards[n]) for n in ids]
        # A short warm-up (connections, caches, the first heartbeat's baseline), then the measured run.
        for phase_seconds in (2.0, seconds):
            q = mp.get_context("fork").Queue()
            procs = [
                mp.get_context("fork").Process(
                    target=_load, args=(url, nodes[c::clients], phase_seconds, concurrency, q)
                )
                for c in range(clients)
            ]
            t0 = time.perf_counter()
            for p in procs:
                p.start()
            results = [q.get() for _ in procs]
            for p in procs:
                p.join()
            elapsed = time.perf_counter() - t0
        lat = [x for r in results for x in r[0]]
        errors = sum(r[1] for r in results)
        lines += [
            f"{n_nodes} nodes; gunicorn {workers} workers x {threads} threads; "
            f"load: {clients} processes x {concurrency} connections, {seconds:.0f} s, "
            f"on the same {os.cpu_count()} cores",
            f"heartbeats: {len(lat) / elapsed:,.0f}/s sustained ({len(lat)} in {elapsed:.1f} s, {errors} errors)",
            f"heartbeat latency: p50 {_percentile(lat, 50) * 1000:.1f} ms, p99 {_percentile(lat, 99) * 1000:.1f} ms",
            f"register (8 GPUs, new node, join token): median {statistics.median(reg_times) * 1000:.1f} ms, "
            f"p99 {_percentile(reg_times, 99) * 1000:.1f} ms",
            f"re-register (8 GPUs, 4 shards adopted): median {statistics.median(rereg) * 1000:.1f} ms, "
            f"p99 {_percentile(rereg, 99) * 1000:.1f} ms",
        ]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    return lines
