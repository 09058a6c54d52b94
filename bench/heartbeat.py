"""Heartbeats per second against the real stack: the production web server, PostgreSQL, Redis.

Creates a fresh database (<test database>_bench), migrates it, starts the web
server as `make run` does (scripts/serve.sh: granian, or gunicorn) on a free
loopback port, registers NODES 8-GPU nodes over HTTP (timing each
registration), gives each node 4 running shards, then drives heartbeats as
the agent sends them (8 GPUs with sensors and wear, 8 IB ports with growing
counters, 4 shards; about 9 KB of JSON) from load-generator processes
holding keep-alive connections: first as fast as answers come back, then at
a fixed offered rate with latency measured from each heartbeat's scheduled
time. Reports heartbeats/s, latency percentiles, and the CPU each heartbeat
costs the server, PostgreSQL, Redis and the load generator.

The load generator runs on the same cores as the server, so the figures are
what the server gets while sharing the machine with its own clients (and
with whatever else runs: the CPU per heartbeat is the figure that does not
depend on that).

Knobs (environment): BENCH_HB_NODES (default 500), BENCH_HB_SECONDS (10 per
phase), BENCH_HB_RATE (offered heartbeats/s of the paced phase, 1000; 0
skips it), BENCH_HB_SERVER (granian or gunicorn), BENCH_HB_WORKERS (server
processes, one per core), BENCH_HB_THREADS (threads per process, 8),
BENCH_HB_CLIENTS (load processes, 2), BENCH_HB_CONCURRENCY (connections per
load process, 8), BENCH_HB_SHARDS (4 shards a node; 0: none, as most of a
fleet before its replicas are placed, and no re-registration measured).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import llmgw_wire as wire
from bench import procs

ROOT = Path(__file__).resolve().parent.parent


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            # Persistent connections, one per server thread (a fixed number), as the figures were measured.
            "DATABASE_POOL_MAX": "0",
            "DATABASE_CONN_MAX_AGE": "600",
            "SECRET_KEY": secrets.token_urlsafe(32),
            "DEBUG": "0",
            "LLMGW_JOIN_TOKEN": join,
            "CELERY_BROKER_URL": "memory://",
            # Redis, as the Redis CPU figures assume: unset, the server would fall back to its file cache.
            "REDIS_URL": os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
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


def heartbeat_payload(node_id: str = "node-a", *, at: float | None = None, counters: int = 0, **extra) -> dict:
    """A realistic heartbeat: 8 GPUs with sensors and wear, 8 IB ports with counters; `extra` adds or replaces fields.

    The tests' heartbeat too: no shards, no acknowledgements, no IMEX unless given.
    """
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
    gpus = [
        {
            "index": i,
            "temp_c": 54.0 + i,
            "memory_temp_c": 60.0,
            "power_w": 402.5,
            "power_limit_w": 700.0,
            "util_percent": 93.0,
            "mem_util_percent": 41.0,
            "memory_used_mb": 71234.0,
            "memory_total_mb": 81559.0,
            "sm_clock_mhz": 1980.0,
            "wear": wear,
        }
        for i in range(8)
    ]
    ports = [
        {
            "hca": f"mlx5_{i}",
            "port": 1,
            "state": "4: ACTIVE",
            "phys_state": "5: LinkUp",
            "rate_gbps": 400,
            "link_layer": "InfiniBand",
            "counters": {
                "port_xmit_data": counters,
                "port_rcv_data": 2 * counters,
                "symbol_error": 0,
                "link_downed": 0,
            },
            "sm_guid": "0xa088c20300b3c4d0",
            "sm_lid": 1,
        }
        for i in range(8)
    ]
    p = {
        "node_id": node_id,
        "at": at,
        "load": {"cpu_percent": 35.5, "cpu_count": 224, "load1": 12.0, "mem_used_bytes": 2**40},
        "gpus": gpus,
        "ib_ports": ports,
        "shards": [],
        "acks": [],
    }
    p.update(extra)
    return p


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


def heartbeat_template(node_id: str, shards: list[str]) -> str:
    """A node's heartbeat as JSON with %-placeholders for what changes from one heartbeat to the next.

    The agent's clock, each port's counters and each card's temperature,
    power and utilisation vary; the load generator fills them in with one
    string formatting instead of building and encoding the payload each time,
    so it leaves the cores to the server.
    """
    # As the agent sends it: every field of the wire model but the empty ones (exclude_none).
    body = heartbeat_payload(
        node_id,
        shards=[{"shard_id": s, "state": "ready"} for s in shards],
        imex={"state": "UP", "channels": 2048},
    )
    payload = wire.Heartbeat.model_validate(body).model_dump(mode="json", exclude_none=True)
    payload["at"] = "@at@"
    for i, g in enumerate(payload["gpus"]):
        g["temp_c"], g["power_w"], g["util_percent"] = f"@temp{i}@", f"@power{i}@", f"@util{i}@"
    for i, p in enumerate(payload["ib_ports"]):
        p["counters"]["port_xmit_data"], p["counters"]["port_rcv_data"] = f"@tx{i}@", f"@rx{i}@"
    text = json.dumps(payload).replace("%", "%%")
    return re.sub(r'"@(\w+)@"', r"%(\1)s", text)


def heartbeat_values(tick: int, salt: int) -> dict[str, str]:
    """The changing values of a node's `tick`-th heartbeat: counters only grow."""
    values = {"at": repr(1_800_000_000.0 + 5 * tick)}
    for i in range(8):
        values[f"temp{i}"] = repr(55.0 + (tick + i + salt) % 20)
        values[f"power{i}"] = repr(400.0 + (tick * 7 + i + salt) % 250)
        values[f"util{i}"] = repr(float((tick * 3 + i + salt) % 101))
        values[f"tx{i}"] = str((10**9 + i + salt) * tick)
        values[f"rx{i}"] = str((2 * 10**9 + i + salt) * tick)
    return values


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, token: str) -> tuple[int, bytes]:
    conn.request(
        "POST", path, body=body, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    return resp.status, resp.read()


class KeepAlive:
    """A minimal HTTP/1.1 client on one keep-alive connection: pre-built request head, Content-Length answers.

    http.client parses every answer's headers with the email package, which
    costs the shared cores more than the heartbeat's JSON; the server's
    answers here are small and always carry Content-Length.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.buf = None, b""

    def post(self, path: str, body: bytes, token: str) -> tuple[int, bytes]:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + body)
        while b"\r\n\r\n" not in self.buf:
            self._read()
        raw_head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = raw_head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        closing = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                closing = True
        while len(rest) < length:
            self.buf = rest
            self._read()
            rest = self.buf
        answer, self.buf = rest[:length], rest[length:]
        if closing:
            self.close()
        return status, answer

    def _read(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk


# One request of a load generator: (node id, round, node's place in its connection's list, requests
# the connection sent before) -> (what it counts as, path, body).
Request = Callable[[str, int, int, int], tuple[str, str, bytes]]


def paced_requests(
    port: int, nodes: list, seconds: float, concurrency: int, rate: float, request: Request
) -> tuple[dict[str, list[float]], int]:
    """`concurrency` threads, each with its own keep-alive connection, sending `request`s for `seconds`.

    With `rate` (requests a second for this process) each connection sends
    on a fixed schedule and latency is measured from the scheduled time, so a
    server that falls behind is charged for the queueing it causes; without,
    each connection sends as fast as answers come back. Returns the
    latencies by what `request` said each was, and the count of errors.
    """
    lat: dict[str, list[float]] = {}
    errors = [0]
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + seconds

    def worker(k: int) -> None:
        mine = nodes[k::concurrency]
        local: dict[str, list[float]] = {}
        bad = 0
        interval = concurrency / rate if rate else 0.0
        scheduled = start + interval * k / concurrency
        conn = KeepAlive(port)
        tick = 1
        sent = k
        while time.perf_counter() < deadline:
            for salt, (node_id, cred, _) in enumerate(mine):
                now = time.perf_counter()
                if now >= deadline:
                    break
                kind, path, body = request(node_id, tick, salt, sent)
                sent += 1
                if interval:
                    if now < scheduled:
                        time.sleep(scheduled - now)
                    t0 = scheduled
                    scheduled += interval
                else:
                    t0 = time.perf_counter()
                try:
                    status, _ = conn.post(path, body, cred)
                except (OSError, ValueError, IndexError):
                    conn.close()
                    status = 0
                local.setdefault(kind, []).append(time.perf_counter() - t0)
                if status != 200:
                    bad += 1
            tick += 1
        conn.close()
        with lock:
            for kind, values in local.items():
                lat.setdefault(kind, []).extend(values)
            errors[0] += bad

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, errors[0]


def _load(port: int, nodes: list[tuple[str, str, list[str]]], seconds: float, concurrency: int, rate: float, q) -> None:
    """One load-generator process sending full heartbeats (see paced_requests); (latencies, errors) through `q`."""
    templates = {node_id: heartbeat_template(node_id, shards) for node_id, _, shards in nodes}

    def heartbeat(node_id: str, tick: int, salt: int, sent: int) -> tuple[str, str, bytes]:
        return "heartbeat", "/api/v1/agent/heartbeat", (templates[node_id] % heartbeat_values(tick, salt)).encode()

    lat, errors = paced_requests(port, nodes, seconds, concurrency, rate, heartbeat)
    q.put((lat.get("heartbeat", []), errors))


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _wait_until_up(port: int, server: subprocess.Popen) -> None:
    for _ in range(300):
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start listening")


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class CPUMeter:
    """CPU seconds used by the server's processes, its PostgreSQL backends, Redis and the load generator.

    Throughput on a shared machine depends on what else runs; CPU per
    heartbeat does not, and says what the heartbeat costs whole.
    """

    def __init__(self, server_pid: int, db_url: str) -> None:
        self.server_pid = server_pid
        self.db_url = db_url

    def _pg_pids(self) -> list[int]:
        import psycopg

        name = urlsplit(self.db_url).path.lstrip("/")
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", [name]
            ).fetchall()
        return [r[0] for r in rows]

    def _redis(self) -> float:
        import redis

        info = redis.Redis.from_url(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0").info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def sample(self) -> dict[str, float]:
        # Every process below the script: the socket's holder, the master and its workers (llmgw/listen.py).
        server = [self.server_pid, *procs.descendants(self.server_pid)]
        t = os.times()
        return {
            "server": sum(_proc_cpu(p) for p in server),
            "postgres": sum(_proc_cpu(p) for p in self._pg_pids()),
            "redis": self._redis(),
            "load": t.children_user + t.children_system,
        }


def fan_out(load, port: int, nodes: list, clients: int, *args) -> tuple[list, float]:
    """Run `load(port, its share of nodes, *args, queue)` in `clients` processes; (each one's result, elapsed)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=load, args=(port, nodes[c::clients], *args, q)) for c in range(clients)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return results, time.perf_counter() - t0


def _drive(port: int, nodes: list, seconds: float, clients: int, concurrency: int, rate: float) -> tuple:
    """Run the load processes for `seconds`; returns (latencies, errors, elapsed)."""
    results, elapsed = fan_out(_load, port, nodes, clients, seconds, concurrency, rate / clients)
    return [x for r in results for x in r[0]], sum(r[1] for r in results), elapsed


def _figures(label: str, lat: list[float], errors: int, elapsed: float, cpu: dict[str, float]) -> list[str]:
    n = max(1, len(lat))
    per = {k: v / n * 1000 for k, v in cpu.items()}
    total = sum(per.values())
    return [
        f"{label}: {len(lat) / elapsed:,.0f}/s ({len(lat)} in {elapsed:.1f} s, {errors} errors), "
        f"p50 {_percentile(lat, 50) * 1000:.1f} ms, p99 {_percentile(lat, 99) * 1000:.1f} ms, "
        f"max {max(lat) * 1000:.1f} ms",
        f"  CPU per heartbeat: {total:.2f} ms = server {per['server']:.2f} + PostgreSQL {per['postgres']:.2f} "
        f"+ Redis {per['redis']:.2f} + load generator {per['load']:.2f}; "
        f"{os.cpu_count()} idle cores would carry {(os.cpu_count() or 1) * 1000 / total:,.0f}/s",
    ]


def _measured(meter: CPUMeter, *args) -> tuple:
    before = meter.sample()
    lat, errors, elapsed = _drive(*args)
    after = meter.sample()
    return lat, errors, elapsed, {k: after[k] - before[k] for k in before}


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _server_description(env: dict[str, str]) -> str:
    """The server settings scripts/serve.sh runs with."""
    workers = env.get("WEB_CONCURRENCY") or os.cpu_count()
    threads = env.get("LLMGW_WEB_THREADS") or 8
    return f"{env.get('LLMGW_WEB_SERVER') or 'granian'}, {workers} workers x {threads} threads"


class Served(NamedTuple):
    """A control plane a benchmark runs against."""

    port: int
    join: str
    env: dict[str, str]
    pid: int
    db_url: str


@contextmanager
def served_control_plane(suffix: str) -> Iterator[Served]:
    """A fresh database `<name>_<suffix>`, migrated, and the web server as `make run` starts it
    (scripts/serve.sh) on a port of its own."""
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    db_url = urlunsplit(parts._replace(path=f"/{parts.path.lstrip('/') or 'llmgw'}_{suffix}"))
    _recreate_database(db_url)
    join = secrets.token_urlsafe(24)
    env = _server_env(db_url, join)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    port = _free_port()
    for knob, var in (("BENCH_HB_SERVER", "LLMGW_WEB_SERVER"), ("BENCH_HB_WORKERS", "WEB_CONCURRENCY"),
                      ("BENCH_HB_THREADS", "LLMGW_WEB_THREADS")):  # fmt: skip
        if os.environ.get(knob):
            env[var] = os.environ[knob]
    env["PYTHON"] = sys.executable
    env["LLMGW_WEB_LOG_LEVEL"] = "warning"
    server = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh"), f"127.0.0.1:{port}"], cwd=ROOT, env=env)
    try:
        _wait_until_up(port, server)
        yield Served(port, join, env, server.pid, db_url)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def run() -> list[str]:
    n_nodes = _env_int("BENCH_HB_NODES", 500)
    seconds = float(os.environ.get("BENCH_HB_SECONDS", 10))
    rate = float(os.environ.get("BENCH_HB_RATE", 1000))
    clients = _env_int("BENCH_HB_CLIENTS", 2)
    concurrency = _env_int("BENCH_HB_CONCURRENCY", 8)

    load_before = _loadavg()
    lines: list[str] = []
    with served_control_plane("bench") as served:
        port, join, env = served.port, served.join, served.env
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        # Registration of an 8-GPU node, one at a time.
        creds: dict[str, str] = {}
        reg_times = []
        ids = [f"bench-{i:05d}" for i in range(n_nodes)]
        for node_id in ids:
            body = json.dumps(register_payload(node_id)).encode()
            t0 = time.perf_counter()
            status, answer = _post(conn, "/api/v1/agent/register", body, join)
            reg_times.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"registration of {node_id}: {status} {answer[:300]!r}")
            creds[node_id] = json.loads(answer)["credential"]
        with_shards = _env_int("BENCH_HB_SHARDS", 4) > 0
        shards: dict[str, list[str]] = {n: [] for n in ids}
        if with_shards:
            made = subprocess.run(
                [sys.executable, "-c", _MAKE_SHARDS], cwd=ROOT, env=env, input=json.dumps(ids),
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            shards = json.loads(made.stdout)
        # Re-registration with the node's credential, adopting 4 running shards.
        rereg = []
        for node_id in ids[: min(100, n_nodes)] if with_shards else ():
            running = [{"replica_id": str(uuid.uuid4()), "shard_id": s, "state": "ready"} for s in shards[node_id]]
            body = json.dumps(register_payload(node_id, running)).encode()
            t0 = time.perf_counter()
            status, answer = _post(conn, "/api/v1/agent/register", body, creds[node_id])
            rereg.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"re-registration of {node_id}: {status} {answer[:300]!r}")
        conn.close()
        nodes = [(n, creds[n], shards[n]) for n in ids]
        # A short warm-up (connections, the first heartbeat's baseline), then as fast as answers come
        # back, then at a fixed offered rate.
        _drive(port, nodes, 2.0, clients, concurrency, 0)
        meter = CPUMeter(served.pid, served.db_url)
        saturated = _measured(meter, port, nodes, seconds, clients, concurrency, 0)
        paced = _measured(meter, port, nodes, seconds, clients, concurrency, rate) if rate else None
        lines += [
            f"{n_nodes} nodes; server: {_server_description(env)}; load: {clients} processes x {concurrency} "
            f"keep-alive connections, on the same {os.cpu_count()} cores (load average at the start: {load_before})",
            *_figures("heartbeats, as fast as answered", *saturated),
            *(_figures(f"heartbeats, offered {rate:,.0f}/s", *paced) if paced else []),
            f"register (8 GPUs, new node, join token): median {statistics.median(reg_times) * 1000:.1f} ms, "
            f"p99 {_percentile(reg_times, 99) * 1000:.1f} ms",
        ]
        if rereg:
            lines.append(
                f"re-register (8 GPUs, 4 shards adopted): median {statistics.median(rereg) * 1000:.1f} ms, "
                f"p99 {_percentile(rereg, 99) * 1000:.1f} ms"
            )
        else:
            lines.append("heartbeats without shards (BENCH_HB_SHARDS=0): no re-registration")
    return lines
