"""Lease renewals per second against the real stack: the web's endpoint and the gateway's batched one side by side.

The stack of bench/heartbeat.py (a fresh database, the production web server
as `make run` starts it, PostgreSQL, Redis, load-generator processes holding
keep-alive connections on the same cores), and the gateway's ASGI process as
`make run` starts it (scripts/gateway.sh), NODES 8-GPU nodes with 4 shards
each, every node's status sent once first (as an agent does after
registering). Then BENCH_LEASE_RUNS (3) runs, each of:

- leases alone to the web's endpoint (Django's request cycle, a statement a
  lease), as fast as answers come back;
- leases alone to the gateway's endpoint (agents/lease_asgi.py: batched, a
  statement a batch), as fast as answers come back;
- leases to the gateway's endpoint offered at BENCH_LEASE_RATE a second
  (2,000: ten thousand nodes at 5 s), latency measured from each request's
  scheduled time, so queueing is charged;

each reporting the CPU a lease costs the web's processes, the gateway's and
PostgreSQL (and Redis, shared with whatever else runs), min/median/max over
the runs, and the cores the server and PostgreSQL kept busy. Then, once,
against the web's endpoint, unless BENCH_LEASE_MIX is 0: leases with one full
heartbeat (about 9 KB) in every BENCH_LEASE_MIX requests (12: a status a
minute at a 5 s interval, the floor) offered at BENCH_LEASE_RATE, the same
mix as fast as answered, and full heartbeats alone: what a lease saves.

Knobs (environment): BENCH_LEASE_NODES (2000), BENCH_LEASE_SECONDS (10 per
phase), BENCH_LEASE_RUNS (3), BENCH_LEASE_RATE (2000), BENCH_LEASE_MIX (12;
0: leases only), LLMGW_LEASE_BATCH_S (the gateway's window), and
bench/heartbeat.py's BENCH_HB_SERVER, BENCH_HB_WORKERS, BENCH_HB_THREADS,
BENCH_HB_CLIENTS, BENCH_HB_CONCURRENCY (64 here). The node count does not change a
renewal's cost (one primary-key lookup and update): each node simply renews
more often than every 5 s here.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench import procs
from bench.heartbeat import (
    _MAKE_SHARDS,
    CPUMeter,
    _env_int,
    _free_port,
    _loadavg,
    _percentile,
    _post,
    _proc_cpu,
    _server_description,
    _wait_until_up,
    fan_out,
    heartbeat_template,
    heartbeat_values,
    paced_requests,
    register_payload,
    served_control_plane,
)

ROOT = Path(__file__).resolve().parent.parent
LEASE = "/api/v1/agent/lease"
HEARTBEAT = "/api/v1/agent/heartbeat"


def lease_body(node_id: str, at: float) -> bytes:
    """A lease as the agent sends it (wire.Lease, exclude_none): node id and clock, no acks."""
    return json.dumps({"node_id": node_id, "at": at, "acks": []}, separators=(",", ":")).encode()


def _load(port: int, nodes: list, seconds: float, concurrency: int, rate: float, mix: int, q) -> None:
    """One load process: `concurrency` keep-alive connections; every `mix`-th request a full heartbeat.

    Returns (lease latencies, heartbeat latencies, errors) through `q`.
    """
    templates = {node_id: heartbeat_template(node_id, shards) for node_id, _, shards in nodes} if mix else {}

    def lease_or_status(node_id: str, tick: int, salt: int, sent: int) -> tuple[str, str, bytes]:
        if mix and sent % mix == 0:
            return "full", HEARTBEAT, (templates[node_id] % heartbeat_values(tick, salt)).encode()
        return "lease", LEASE, lease_body(node_id, 1_800_000_000.0 + 5 * tick)

    lat, errors = paced_requests(port, nodes, seconds, concurrency, rate, lease_or_status)
    q.put((lat.get("lease", []), lat.get("full", []), errors))


def _drive(port: int, nodes: list, seconds: float, clients: int, concurrency: int, rate: float, mix: int) -> tuple:
    """Run the load processes for `seconds`; returns (lease latencies, full-heartbeat latencies, errors, elapsed)."""
    results, elapsed = fan_out(_load, port, nodes, clients, seconds, concurrency, rate / clients, mix)
    leases = [x for r in results for x in r[0]]
    fulls = [x for r in results for x in r[1]]
    return leases, fulls, sum(r[2] for r in results), elapsed


def _measured(meter: CPUMeter, *args) -> tuple:
    before = meter.sample()
    leases, fulls, errors, elapsed = _drive(*args)
    after = meter.sample()
    return leases, fulls, errors, elapsed, {k: after[k] - before[k] for k in before}


def _ms(values: list[float], p: float) -> str:
    return f"{_percentile(values, p) * 1000:.1f}" if values else "-"


def _figures(label: str, leases: list, fulls: list, errors: int, elapsed: float, cpu: dict[str, float]) -> list[str]:
    n = max(1, len(leases) + len(fulls))
    per = {k: v / n * 1000 for k, v in cpu.items()}
    served = per["server"] + per["postgres"] + per["redis"]
    both = leases + fulls
    lines = [
        f"{label}: {n / elapsed:,.0f} requests/s ({len(leases)} leases + {len(fulls)} full heartbeats "
        f"in {elapsed:.1f} s, {errors} errors); leases {len(leases) / elapsed:,.0f}/s",
        f"  latency, all: p50 {_ms(both, 50)} ms, p99 {_ms(both, 99)} ms, max {max(both) * 1000:.1f} ms; "
        f"leases p99 {_ms(leases, 99)} ms; full heartbeats p99 {_ms(fulls, 99)} ms",
        f"  CPU per request: server + PostgreSQL + Redis {served:.3f} ms = {per['server']:.3f} + "
        f"{per['postgres']:.3f} + {per['redis']:.3f}; load generator {per['load']:.3f}",
    ]
    return lines


def _tree_cpu(pid: int) -> float:
    # Every process below the script: the socket's holder, the master and its workers (llmgw/listen.py).
    return sum(_proc_cpu(p) for p in (pid, *procs.descendants(pid)))


class BothMeter(CPUMeter):
    """CPUMeter, with the gateway's processes (the batched lease endpoint) counted apart from the web's."""

    def __init__(self, server_pid: int, gateway_pid: int, db_url: str) -> None:
        super().__init__(server_pid, db_url)
        self.gateway_pid = gateway_pid

    def sample(self) -> dict[str, float]:
        return {**super().sample(), "gateway": _tree_cpu(self.gateway_pid)}


@contextmanager
def served_gateway(env: dict[str, str]) -> Iterator[tuple[int, int]]:
    """The gateway's ASGI process as `make run` starts it (scripts/gateway.sh), on a port of its own: (port, pid)."""
    port = _free_port()
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gateway.sh"), f"127.0.0.1:{port}"], cwd=ROOT, env=env)
    try:
        _wait_until_up(port, proc)
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _per_lease(leases: list, fulls: list, errors: int, elapsed: float, cpu: dict[str, float]) -> dict[str, float]:
    n = max(1, len(leases) + len(fulls))
    per = {k: v / n * 1000 for k, v in cpu.items()}
    return {
        "served": per["server"] + per["gateway"] + per["postgres"],
        "web": per["server"],
        "gateway": per["gateway"],
        "postgres": per["postgres"],
        "redis": per["redis"],
        "rate": n / elapsed,
        "p99": _percentile(leases, 99) * 1000 if leases else 0.0,
        "errors": errors,
        # Cores the server and PostgreSQL kept busy while it ran.
        "cores": (cpu["server"] + cpu["gateway"] + cpu["postgres"]) / elapsed,
    }


def _spread(values: list[float], fmt: str) -> str:
    ordered = sorted(values)
    return "/".join(format(v, fmt) for v in (ordered[0], ordered[len(ordered) // 2], ordered[-1]))


def _compared(label: str, runs: list[dict[str, float]]) -> list[str]:
    def col(k: str, fmt: str = ".3f") -> str:
        return _spread([r[k] for r in runs], fmt)

    return [
        f"{label}: CPU per lease, server + PostgreSQL {col('served')} ms (min/median/max of {len(runs)} runs) "
        f"= web {col('web')} + gateway {col('gateway')} + PostgreSQL {col('postgres')}; Redis {col('redis')}",
        f"  {col('rate', ',.0f')} leases/s, p99 {col('p99', '.1f')} ms, server + PostgreSQL busy "
        f"{col('cores', '.2f')} cores; errors {sum(int(r['errors']) for r in runs)}",
    ]


def run() -> list[str]:
    n_nodes = _env_int("BENCH_LEASE_NODES", 2000)
    seconds = float(os.environ.get("BENCH_LEASE_SECONDS", 10))
    rate = float(os.environ.get("BENCH_LEASE_RATE", 2000))
    mix = _env_int("BENCH_LEASE_MIX", 12)
    runs = _env_int("BENCH_LEASE_RUNS", 3)
    clients = _env_int("BENCH_HB_CLIENTS", 2)
    # Many more connections than the heartbeat bench's: a lease waits out the gateway's window
    # (LLMGW_LEASE_BATCH_S, 20 ms), and 16 connections each waiting it would offer at most 800 a second.
    concurrency = _env_int("BENCH_HB_CONCURRENCY", 64)

    load_before = _loadavg()
    lines: list[str] = []
    with served_control_plane("lease") as served, served_gateway(served.env) as (gw_port, gw_pid):
        port, join, env = served.port, served.join, served.env
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        ids = [f"lease-{i:05d}" for i in range(n_nodes)]
        creds: dict[str, str] = {}
        for node_id in ids:
            status, answer = _post(conn, "/api/v1/agent/register", json.dumps(register_payload(node_id)).encode(), join)
            if status != 200:
                raise RuntimeError(f"registration of {node_id}: {status} {answer[:300]!r}")
            creds[node_id] = json.loads(answer)["credential"]
        made = subprocess.run(
            [sys.executable, "-c", _MAKE_SHARDS], cwd=ROOT, env=env, input=json.dumps(ids),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        shards = json.loads(made.stdout)
        nodes = [(n, creds[n], shards[n]) for n in ids]
        # Every node's status once (an agent's first heartbeat after registering), then a warm-up.
        for node_id, cred, node_shards in nodes:
            body = (heartbeat_template(node_id, node_shards) % heartbeat_values(1, 0)).encode()
            status, answer = _post(conn, HEARTBEAT, body, cred)
            if status != 200 or not json.loads(answer).get("leases"):
                raise RuntimeError(f"status of {node_id}: {status} {answer[:300]!r}")
        conn.close()
        _drive(port, nodes, 2.0, clients, concurrency, 0, 0)
        _drive(gw_port, nodes, 2.0, clients, concurrency, 0, 0)
        meter = BothMeter(served.pid, gw_pid, served.db_url)
        # The two paths side by side, run after run: the web's endpoint (Django's request cycle,
        # a statement per lease) and the gateway's (batched), as fast as answered; then the
        # gateway's at the offered rate.
        django, batched, offered = [], [], []
        for _ in range(runs):
            django.append(_per_lease(*_measured(meter, port, nodes, seconds, clients, concurrency, 0, 0)))
            batched.append(_per_lease(*_measured(meter, gw_port, nodes, seconds, clients, concurrency, 0, 0)))
            if rate:
                offered.append(_per_lease(*_measured(meter, gw_port, nodes, seconds, clients, concurrency, rate, 0)))
        lines += [
            f"{n_nodes} nodes; server: {_server_description(env)}; gateway: scripts/gateway.sh "
            f"(LLMGW_LEASE_BATCH_S {env.get('LLMGW_LEASE_BATCH_S') or 'default'}); load: {clients} processes x "
            f"{concurrency} keep-alive connections, on the same {os.cpu_count()} cores "
            f"(load average at the start: {load_before})",
            *_compared("web endpoint (Django), leases alone, as fast as answered", django),
            *_compared("gateway endpoint (batched), leases alone, as fast as answered", batched),
            *(_compared(f"gateway endpoint (batched), offered {rate:,.0f}/s", offered) if offered else []),
        ]
        if mix:
            meter = CPUMeter(served.pid, served.db_url)
            paced = _measured(meter, port, nodes, seconds, clients, concurrency, rate, mix) if rate else None
            mixed = _measured(meter, port, nodes, seconds, clients, concurrency, 0, mix)
            # The same machine, the same moment: what a full heartbeat costs, for comparison.
            full = _measured(meter, port, nodes, seconds, clients, concurrency, 0, 1)
            lines += [
                *(_figures(f"web: 1 full heartbeat in {mix}, offered {rate:,.0f}/s", *paced) if paced else []),
                *_figures(f"web: 1 full heartbeat in {mix}, as fast as answered", *mixed),
                *_figures("web: full heartbeats alone, as fast as answered", *full),
            ]
        lines.append(f"load average at the end: {_loadavg()}")
    return lines
