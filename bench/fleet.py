"""The whole loop with a simulated fleet: the production web server, a Celery worker with beat, PostgreSQL, Redis.

Creates a fresh database (<configured name>_fleet), migrates it, starts the
web server as `make run` does (scripts/serve.sh) and one Celery worker with
beat (`-B`, broker on REDIS_URL), then runs BENCH_FLEET_NODES virtual nodes
(llmgw_sim/fleet.py, over the shipped hardware profiles, in
BENCH_FLEET_PROCS processes) against them. Phases:

1. join storm: every node starts at once (BENCH_FLEET_RAMP spreads them);
   time until all are registered, refusals by status, nodes never let in;
2. steady state for BENCH_FLEET_SECONDS: heartbeats/s, their latency
   (p50/p99, as the nodes measure it), CPU per node per second of the server,
   PostgreSQL (the bench database's backends), Redis, the worker and the fleet;
   memory of every process;
3. scale-up: a deployment of BENCH_FLEET_REPLICAS single-GPU echo replicas;
   time to all placed, to all ready (shards ready as the simulated nodes report),
   and each part's CPU during it;
4. BENCH_FLEET_SILENT nodes that host replicas go silent at once: time to
   the unreachable and the lost verdicts, each lost verdict's lag after its
   node's last renewal, and from the last lost verdict to every replica ready
   again elsewhere (thresholds BENCH_FLEET_UNREACHABLE_AFTER
   and BENCH_FLEET_LOST_AFTER, sweep and reconcile every BENCH_FLEET_TICK s);
5. a scrape of /metrics: time and size.

The phases share a budget of BENCH_FLEET_BUDGET seconds (840, from the first
node's start): each waits at most what its own timeout and the budget allow,
and a phase that runs out says how far it got instead of waiting on (the join
storm is bounded by BENCH_FLEET_JOIN_TIMEOUT, 300 s). BENCH_FLEET_REPLICAS=0
skips the scale-up and the silent nodes, BENCH_FLEET_SILENT=0 the latter.
BENCH_FLEET_KEEPALIVE=0 has the virtual nodes send no lease while a status
waits (llmgw_agent/keepalive.py), BENCH_FLEET_PRIORITY=0 their routine
statuses unmarked (llmgw_agent/status.py ROUTINE), BENCH_FLEET_FLOOR_DIGEST=0
their status floors sent whole instead of as digests, to measure what each changes.
BENCH_FLEET_NICE=<n> runs the simulator at that niceness: the control plane
first on the shared cores, as when the agents are on machines of their own.

Everything runs on the same cores as the server (the fleet, the worker, the
database), so the figures are those of the whole loop sharing one machine.
Redis's CPU is what the whole Redis server used, whoever asked.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

import llmgw_wire as wire
from bench import procs
from bench.heartbeat import _free_port, _loadavg, _proc_cpu, _recreate_database, _server_description, _wait_until_up
from llmgw_agent.loop import LEASE_FALLBACK_S
from llmgw_sim.fleet import EDGES, histogram_percentile
from llmgw_sim.fleet_stats import Stats

ROOT = Path(__file__).resolve().parent.parent


# Keep-alive connections per simulator process, to the web server and as many to the gateway. Agents
# have one each; a process's 2,500 nodes share these, and at 32 a scale-up's slower answers had its
# requests queue for a free one (p50 0.26 s, p99 4.8 s, the simulator's own wait) until live nodes
# were judged unreachable: the simulator throttling what it measured.
CONNECTIONS = 128


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _database_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{parts.path.lstrip('/') or 'llmgw'}_fleet"))


def _rss_mb(pid: int) -> float:
    """A process's resident memory in MB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    return [pid, *procs.descendants(pid)]


_CREATE = """
import json, sys, time, django
django.setup()
from django.db import transaction
from placement import queueing
from placement.models import Deployment, EngineProfile
spec = json.load(sys.stdin)
with transaction.atomic():
    profile = EngineProfile.objects.create(name="fleet-echo-1", engine="echo", gpus_per_node=1, startup_timeout_s=600)
    dep = Deployment.objects.create(name="fleet", served_model="fleet", profile=profile, replicas=spec["replicas"])
    queueing.queue_reconcile()
print(dep.id, time.time())
"""


class Loop:
    """The control plane and the fleet as processes, and what the bench reads of them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.nodes = int(_env("BENCH_FLEET_NODES", 1000))
        self.procs_n = int(_env("BENCH_FLEET_PROCS", max(1, -(-self.nodes // 2500))))
        self.interval = _env("BENCH_FLEET_INTERVAL", 5.0)
        self.tick = _env("BENCH_FLEET_TICK", 2.0)
        # As `make run` starts it: a second process takes the next task while one reconcile pass runs.
        self.concurrency = int(_env("BENCH_FLEET_WORKER_CONCURRENCY", 2))
        self.db_url = _database_url()
        self.join = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
        self.redis_url = redis_url
        self.metrics_token = secrets.token_urlsafe(24)
        self.env = dict(os.environ)
        self.env.update(
            {
                "DJANGO_SETTINGS_MODULE": "llmgw.settings",
                "DATABASE_URL": self.db_url,
                "DATABASE_CONN_MAX_AGE": "600",
                "SECRET_KEY": secrets.token_urlsafe(32),
                "DEBUG": "0",
                "LLMGW_JOIN_TOKEN": self.join,
                # Scraped as Prometheus would be: with its bearer token.
                "LLMGW_METRICS_TOKEN": self.metrics_token,
                # The cache too: without it the control plane falls back to its file cache, and the run
                # measures that (a join storm of 10,000 took 292 s instead of 45) rather than Redis.
                "REDIS_URL": redis_url,
                "CELERY_BROKER_URL": redis_url,
                "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw") + "-fleet",
                "LLMGW_VAR_DIR": str(work / "var"),
                "LLMGW_HEARTBEAT_INTERVAL": str(self.interval),
                "LLMGW_UNREACHABLE_AFTER": str(_env("BENCH_FLEET_UNREACHABLE_AFTER", 10)),
                "LLMGW_LOST_AFTER": str(_env("BENCH_FLEET_LOST_AFTER", 20)),
                "LLMGW_LIVENESS_INTERVAL": str(self.tick),
                "LLMGW_RECONCILE_INTERVAL": str(self.tick),
                "LLMGW_SHARD_PORTS_UNIQUE": "1",
                "LOG_LEVEL": "WARNING",
                "PYTHON": sys.executable,
                "LLMGW_WEB_LOG_LEVEL": "warning",
            }
        )
        # As the control plane's own default, the gateway's process takes the leases in batches
        # (agents/lease_asgi.py, LLMGW_LEASE_URL); BENCH_FLEET_GATEWAY=0: every lease goes to the web server.
        self.gateway_port = _free_port() if _env("BENCH_FLEET_GATEWAY", 1) else None
        if self.gateway_port is not None:
            self.env["LLMGW_LEASE_URL"] = f"http://127.0.0.1:{self.gateway_port}{wire.LEASE_PATH}"
        else:
            self.env["LLMGW_LEASE_URL"] = "off"
        for knob, var in (("BENCH_FLEET_WORKERS", "WEB_CONCURRENCY"), ("BENCH_FLEET_THREADS", "LLMGW_WEB_THREADS")):
            if os.environ.get(knob):
                self.env[var] = os.environ[knob]
        self.server: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.fleet: list[subprocess.Popen] = []
        self.control = work / "control.json"
        self.token_file = work / "join-token"
        self.deadline = float("inf")

    def left(self, timeout: float) -> float:
        """`timeout`, or less when the phases' budget ends sooner (never below zero)."""
        return max(0.0, min(timeout, self.deadline - time.monotonic()))

    # --- processes ----------------------------------------------------------

    def start_control_plane(self) -> None:
        """Migrate a fresh database, start the web server and the worker with beat."""
        _recreate_database(self.db_url)
        (self.work / "var" / "celery").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=self.env, check=True)
        self._redis().delete("celery")  # tasks an earlier, interrupted run left queued
        log = open(self.work / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        self.server = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "serve.sh"), f"127.0.0.1:{self.port}"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wlog = open(self.work / "worker.log", "ab")  # noqa: SIM115
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "llmgw", "worker", "-B", "--concurrency", str(self.concurrency),
             "--loglevel", "WARNING", "-s", str(self.work / "var" / "celery" / "beat-schedule")],
            cwd=ROOT, env=self.env, stdout=wlog, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _wait_until_up(self.port, self.server)
        if self.gateway_port is not None:
            glog = open(self.work / "gateway.log", "ab")  # noqa: SIM115
            self.gateway = subprocess.Popen(
                ["bash", str(ROOT / "scripts" / "gateway.sh"), f"127.0.0.1:{self.gateway_port}"],
                cwd=ROOT, env=self.env, stdout=glog, stderr=subprocess.STDOUT,
            )  # fmt: skip
            _wait_until_up(self.gateway_port, self.gateway)

    def start_fleet(self) -> None:
        """The virtual nodes, BENCH_FLEET_PROCS processes sharing the numbering."""
        self.token_file.write_text(self.join)
        self.control.write_text("{}")
        chunk = -(-self.nodes // self.procs_n)
        for k in range(self.procs_n):
            first, count = k * chunk, min(chunk, self.nodes - k * chunk)
            if count <= 0:
                break
            flog = open(self.work / f"fleet-{k}.log", "ab")  # noqa: SIM115
            # BENCH_FLEET_NICE: the simulator below the control plane's priority, as agents on machines
            # of their own do not take the control plane's cores (its own lateness says what that cost it).
            nice = int(_env("BENCH_FLEET_NICE", 0))
            self.fleet.append(
                subprocess.Popen(
                    [
                        *(["nice", "-n", str(nice)] if nice else []),
                        sys.executable,
                        "-m",
                        "llmgw_sim.fleet",
                        "--control-plane",
                        self.url,
                        "--join-token-file",
                        str(self.token_file),
                        "--nodes",
                        str(count),
                        "--first",
                        str(first),
                        "--interval",
                        str(self.interval),
                        "--ramp",
                        str(_env("BENCH_FLEET_RAMP", 0)),
                        "--connections",
                        str(int(_env("BENCH_FLEET_CONNECTIONS", CONNECTIONS))),
                        "--control",
                        str(self.control),
                        "--stats",
                        str(self.work / f"stats-{k}.json"),
                        # BENCH_FLEET_KEEPALIVE=0: no lease while a status waits, to measure what it changes.
                        *([] if _env("BENCH_FLEET_KEEPALIVE", 1) else ["--no-keepalive"]),
                        # BENCH_FLEET_PRIORITY=0: routine statuses unmarked, the web's front first come first served.
                        *([] if _env("BENCH_FLEET_PRIORITY", 1) else ["--no-priority"]),
                        # BENCH_FLEET_FLOOR_DIGEST=0: status floors sent whole, as before their digests.
                        *([] if _env("BENCH_FLEET_FLOOR_DIGEST", 1) else ["--no-floor-digests"]),
                    ],
                    cwd=ROOT,
                    env=self.env,
                    stdout=flog,
                    stderr=subprocess.STDOUT,
                )
            )

    def stop(self) -> None:
        """Every process the bench started, fleet first."""
        for p in [*self.fleet, self.worker, self.gateway, self.server]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.fleet, self.worker, self.gateway, self.server]:
            if p is None:
                continue
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # --- readings -----------------------------------------------------------

    def _redis(self):
        import redis

        return redis.Redis.from_url(self.redis_url)

    def sql(self, query: str, params: list | None = None) -> list[tuple]:
        """Rows of a query on the bench database."""
        import psycopg

        with psycopg.connect(self.db_url, autocommit=True) as conn:
            return conn.execute(query, params or []).fetchall()

    def stats(self) -> dict:
        """The fleet's counters summed over its processes (every one of llmgw_sim/fleet_stats.py's Stats)."""
        total = Stats().as_dict()
        for k in range(len(self.fleet)):
            try:
                s = json.loads((self.work / f"stats-{k}.json").read_text())
            except (OSError, ValueError):
                continue
            for key, sum_ in total.items():
                got = s.get(key)
                if got is None:
                    continue
                if isinstance(sum_, dict):
                    for code, n in got.items():
                        sum_[code] = sum_.get(code, 0) + n
                elif isinstance(sum_, list):
                    total[key] = [a + b for a, b in zip(sum_, got, strict=True)]
                else:
                    total[key] = sum_ + got
        return total

    def groups(self) -> dict[str, list[int]]:
        """The processes of each part of the loop (PostgreSQL: the bench database's backends)."""
        name = urlsplit(self.db_url).path.lstrip("/")
        pg = [r[0] for r in self.sql("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                                     [name])]  # fmt: skip
        return {
            "server": _tree(self.server.pid) if self.server else [],
            "gateway": _tree(self.gateway.pid) if self.gateway else [],
            "postgres": pg,
            "worker": _tree(self.worker.pid) if self.worker else [],
            "fleet": [p for f in self.fleet for p in _tree(f.pid)],
        }

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each part; Redis's is the whole server's."""
        out = {k: sum(_proc_cpu(p) for p in pids) for k, pids in self.groups().items()}
        info = self._redis().info("cpu")
        out["redis"] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return out

    def memory(self) -> list[str]:
        """Resident memory of every process, by part."""
        parts = []
        for k, pids in self.groups().items():
            sizes = [round(_rss_mb(p)) for p in pids]
            parts.append(f"{k} {sum(sizes):,} MB ({' + '.join(str(s) for s in sizes) or 'none'})")
        rss = int(self._redis().info("memory").get("used_memory_rss", 0)) / 2**20
        return [*parts, f"redis {rss:,.0f} MB (the whole server's)"]

    def within(self, cond, timeout: float, poll: float = 0.25) -> float | None:
        """Seconds until cond() holds; None when it did not within `timeout`. Raises if a process died."""
        t0 = time.monotonic()
        while True:
            for p in [self.server, self.gateway, self.worker, *self.fleet]:
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"a process of the loop exited ({p.args[:4]}): see {self.work}")
            if cond():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(poll)

    def last_error(self, name: str) -> str:
        """The last line of a log that names an error or exception, '' when none does."""
        try:
            lines = (self.work / name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return next((ln.strip()[:300] for ln in reversed(lines) if "Error" in ln or "Exception" in ln), "")

    def log_lines(self, name: str, text: str) -> list[str]:
        """The lines of one of the processes' logs holding `text`, each cut at 300 characters."""
        try:
            lines = (self.work / name).read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln.strip()[:300] for ln in lines if text in ln]

    def log_count(self, name: str, text: str) -> int:
        """How many lines of one of the processes' logs hold `text`."""
        return len(self.log_lines(name, text))


def _ms(seconds: float) -> str:
    """A latency from the histogram, in ms; its last bucket has no upper edge."""
    return f"> {EDGES[-2] * 1e3:,.0f} ms" if seconds == float("inf") else f"{seconds * 1e3:,.1f} ms"


def _hist_diff(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


def _phases(loop: Loop) -> Iterator[str]:
    """Run the phases, yielding each figure as it is measured (a phase that runs out of time says how far it got)."""
    n = loop.nodes
    yield (
        f"{n:,} virtual nodes over the shipped profiles in {loop.procs_n} process(es), heartbeat every "
        f"{loop.interval:g} s +-10%; server: {_server_description(loop.env)}; "
        f"worker: celery -B, concurrency {loop.concurrency}; "
        f"{os.cpu_count()} cores shared with everything else (load average at the start: {_loadavg()})"
    )
    # 1. Join storm.
    t0 = time.monotonic()
    budget = _env("BENCH_FLEET_BUDGET", 840)
    loop.deadline = t0 + budget
    loop.start_fleet()
    join_timeout = loop.left(_env("BENCH_FLEET_JOIN_TIMEOUT", 300))
    loop.within(lambda: loop.stats()["registered"] >= n, join_timeout, poll=0.5)
    joined = time.monotonic() - t0
    s = loop.stats()
    in_db = loop.sql("SELECT count(*) FROM inventory_node")[0][0]
    reg = s["register_latency"]
    yield (
        f"join storm: {s['registered']:,} of {n:,} registered in {joined:.1f} s ({in_db:,} nodes in the database); "
        f"registration p50 {_ms(histogram_percentile(reg, 50))}, p99 {_ms(histogram_percentile(reg, 99))}; "
        f"refusals {s['register_refused'] or 'none'}; transport errors {s['unreachable']}; "
        f"never let in: {n - min(n, in_db)}; load average {_loadavg()}"
    )
    if s["registered"] < n:
        yield f"  the join storm was cut at {join_timeout:.0f} s: the steady state below has nodes still joining"
    # The storm's first statuses, queued behind its registrations, are still the storm: the steady
    # state begins once every node's first status was answered, then one interval to settle.
    if loop.within(lambda: loop.stats()["first_statuses"] >= n, loop.left(join_timeout), poll=0.5) is not None:
        yield f"  every node's first status answered {time.monotonic() - t0:.1f} s after the storm began"
    else:
        yield f"  {loop.stats()['first_statuses']:,} of {n:,} first statuses answered: the steady state has the rest"
    # 2. Steady state: one interval to settle, then measure.
    time.sleep(loop.interval * 1.5)
    seconds = max(1.0, loop.left(_env("BENCH_FLEET_SECONDS", 30)))
    s0, c0, w0 = loop.stats(), loop.cpu(), time.monotonic()
    time.sleep(seconds)
    s1, c1, w1 = loop.stats(), loop.cpu(), time.monotonic()
    elapsed = w1 - w0
    beats = s1["heartbeats"] - s0["heartbeats"]
    leases = s1["leases"] - s0["leases"]
    lat = _hist_diff(s1["latency"], s0["latency"])
    errors = {k: v - s0["heartbeat_errors"].get(k, 0) for k, v in s1["heartbeat_errors"].items()}
    cpu = {k: c1[k] - c0[k] for k in c0}
    per_node = {k: v / elapsed / n * 1e6 for k, v in cpu.items()}
    per_beat = {k: v / max(1, beats) * 1e3 for k, v in cpu.items()}
    late = _hist_diff(s1["lateness"], s0["lateness"])
    yield (
        f"steady state ({elapsed:.0f} s): {beats / elapsed:,.0f} heartbeats/s (expected {n / loop.interval:,.0f}; "
        f"{leases / max(1, beats):.0%} of them leases), "
        f"p50 {_ms(histogram_percentile(lat, 50))}, p99 {_ms(histogram_percentile(lat, 99))} "
        f"(histogram buckets 5% wide), errors {errors or 'none'}; the simulator's own lateness "
        f"p99 {_ms(histogram_percentile(late, 99))}, max {_ms(histogram_percentile(late, 100))}"
    )
    yield (
        "  CPU per node per second (us): "
        + ", ".join(f"{k} {v:.0f}" for k, v in per_node.items())
        + (f"; cores busy: {sum(cpu.values()) / elapsed:.2f}")
    )
    yield "  CPU per heartbeat (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in per_beat.items())
    yield _lease_paths(s0, s1)
    yield "  memory: " + "; ".join(loop.memory())
    yield f"  false verdicts (no node was silenced yet): {_verdicts(loop)}; load average {_loadavg()}"
    # 3. Scale-up.
    replicas = int(_env("BENCH_FLEET_REPLICAS", min(1000, n)))
    if replicas <= 0 or loop.left(budget) <= 0:
        why = "BENCH_FLEET_REPLICAS=0" if replicas <= 0 else f"the budget of {budget:g} s was spent"
        yield f"scale-up and silent nodes skipped: {why}"
        yield from _scrape(loop)
        return
    t0, u0, k0 = time.monotonic(), loop.stats(), loop.cpu()
    spec = json.dumps({"replicas": replicas})
    made = subprocess.run([sys.executable, "-c", _CREATE], cwd=ROOT, env=loop.env, input=spec,
                          capture_output=True, text=True, check=True)  # fmt: skip
    # Timed from the deployment's commit (which queues the reconcile), not from this process's start of the helper.
    dep_id, committed = made.stdout.split()
    dep = int(dep_id)
    count = "SELECT count(*) FROM placement_replica WHERE deployment_id = %s AND state = ANY(%s)"
    timeout = _env("BENCH_FLEET_SCALE_TIMEOUT", max(300, replicas / 2))
    placed = ready = None
    if (
        loop.within(lambda: loop.sql(count, [dep, ["starting", "ready"]])[0][0] >= replicas, loop.left(timeout))
        is not None
    ):
        placed = time.time() - float(committed)
        if loop.within(lambda: loop.sql(count, [dep, ["ready"]])[0][0] >= replicas, loop.left(timeout)) is not None:
            ready = time.time() - float(committed)
    cut_short = loop.log_count("worker.log", "SoftTimeLimitExceeded")
    limits = f"; {cut_short} reconcile pass(es) cut at the task's soft time limit" if cut_short else ""
    refused = loop.log_lines("worker.log", "placements was refused")
    limits += (
        f"; {len(refused)} batch(es) of placements refused and written one by one ({refused[0]})" if refused else ""
    )
    if placed is None or ready is None:
        got = loop.sql(count, [dep, ["starting", "ready"]])[0][0], loop.sql(count, [dep, ["ready"]])[0][0]
        reached = f"all placed {placed:.1f} s after the commit but never all ready at once; " if placed else ""
        yield (
            f"scale-up of {replicas:,} single-GPU replicas: {reached}after {time.monotonic() - t0:.0f} s, "
            f"{got[0]:,} placed and {got[1]:,} ready{limits}; the phases after it are skipped"
        )
        states = loop.sql("SELECT state, count(*) FROM placement_replica WHERE deployment_id = %s GROUP BY 1", [dep])
        yield f"  replicas by state: {dict(states)}; reconcile tasks still queued: {loop._redis().llen('celery')}"
        yield f"  the worker's last words: {loop.last_error('worker.log')}"
        yield from _scrape(loop)
        return
    yield (
        f"scale-up of {replicas:,} single-GPU replicas (reconcile every {loop.tick:g} s and on change): "
        f"all placed in {placed:.1f} s ({replicas / placed:,.0f}/s), all ready {ready:.1f} s "
        f"after the deployment was created (a simulated shard is ready 1.5 s after its StartShard arrives){limits}"
    )
    # A pass dates its events with the moment it began: when the passes that placed the replicas and those
    # that found them ready began, after the commit (a replica is ready in the first pass after its shards).
    by_pass = loop.sql(
        "SELECT to_state, extract(epoch FROM at), count(*) FROM placement_placementevent "
        "WHERE deployment_id = %s AND kind = 'state' AND to_state IN ('starting', 'ready') GROUP BY 1, 2 ORDER BY 2",
        [dep],
    )
    if by_pass:
        began = {to: [float(at) - float(committed) for t, at, _ in by_pass if t == to] for to in ("starting", "ready")}
        placed_by = " + ".join(f"{n:,}" for t, _, n in by_pass if t == "starting")
        yield f"  placed by pass: {placed_by}; " + "; ".join(
            f"{len(at)} pass(es) moved them to {to}, the first beginning {at[0]:.2f} s after the commit, "
            f"the last {at[-1]:.2f} s"
            for to, at in began.items()
            if at
        )
    u1, k1 = loop.stats(), loop.cpu()
    lat, late = _hist_diff(u1["latency"], u0["latency"]), _hist_diff(u1["lateness"], u0["lateness"])
    changed = _hist_diff(u1["changed_latency"], u0["changed_latency"])
    up_s = time.monotonic() - t0
    # Where the scale-up's cores went: the two are shared by every part, so the one that grows is the limit.
    spent = {k: k1[k] - k0[k] for k in k0}
    yield (
        f"  during it ({up_s:.0f} s): {(u1['heartbeats'] - u0['heartbeats']) / up_s:,.0f} heartbeats/s "
        f"({(u1['leases'] - u0['leases']) / max(1, u1['heartbeats'] - u0['heartbeats']):.0%} leases), "
        f"p50 {_ms(histogram_percentile(lat, 50))}, p99 {_ms(histogram_percentile(lat, 99))}, "
        f"max {_ms(histogram_percentile(lat, 100))}; the simulator's own lateness "
        f"p99 {_ms(histogram_percentile(late, 99))}, max {_ms(histogram_percentile(late, 100))}; "
        f"the {sum(changed):,} statuses that reported a change (a shard ready): "
        f"p50 {_ms(histogram_percentile(changed, 50))}, p99 {_ms(histogram_percentile(changed, 99))}, "
        f"max {_ms(histogram_percentile(changed, 100))}"
    )
    yield (
        "  CPU during it (core-seconds): "
        + ", ".join(f"{k} {v:.1f}" for k, v in spent.items())
        + f"; cores busy: {sum(spent.values()) / up_s:.2f}"
    )
    yield _lease_paths(u0, u1)
    # The scale-up loads the web with statuses and the gateway with routes: live nodes misjudged during it count too.
    yield f"  false verdicts so far (no node was silenced yet): {_verdicts(loop)}; load average {_loadavg()}"
    # 4. Nodes going silent at once.
    silent_n = int(_env("BENCH_FLEET_SILENT", 50))
    if silent_n and loop.left(budget) <= 0:
        yield f"silent nodes skipped: the budget of {budget:g} s was spent"
    elif silent_n:
        yield _silence(loop, dep, replicas, silent_n, timeout)
    yield from _scrape(loop)


def _lease_paths(s0: dict, s1: dict) -> str:
    """The gateway's leases told apart: their latency, and how many went to the web server after it failed."""
    lat = _hist_diff(s1["lease_latency"], s0["lease_latency"])
    wait = _hist_diff(s1["pool_wait"], s0["pool_wait"])
    fell = s1["lease_fallbacks"] - s0["lease_fallbacks"]
    to_cp = s1["leases_to_control_plane"] - s0["leases_to_control_plane"]
    why = {
        k: n - s0["statuses_why"].get(k, 0) for k, n in s1["statuses_why"].items() if n > s0["statuses_why"].get(k, 0)
    }
    return (
        f"  leases the gateway answered: {sum(lat):,} ({s1['keepalives'] - s0['keepalives']:,} while a status waited), "
        f"p50 {_ms(histogram_percentile(lat, 50))}, "
        f"p99 {_ms(histogram_percentile(lat, 99))}, max {_ms(histogram_percentile(lat, 100))}; "
        f"leases the gateway failed, each sending its node's leases to the web server for {LEASE_FALLBACK_S:g} s: "
        f"{fell:,}, "
        f"leases sent there instead: {to_cp:,}; full statuses by why: {why or 'none'}; "
        f"status floors sent as digests: {s1['floor_digests'] - s0['floor_digests']:,} "
        f"({s1['floor_digests_unconfirmed'] - s0['floor_digests_unconfirmed']:,} not confirmed); "
        f"the simulator's own wait for a connection (in the latencies) p50 {_ms(histogram_percentile(wait, 50))}, "
        f"p99 {_ms(histogram_percentile(wait, 99))}, max {_ms(histogram_percentile(wait, 100))}"
    )


def _verdicts(loop: Loop) -> str:
    """How many times the sweep moved a node to unreachable and to lost so far, and how many nodes it was."""
    rows = loop.sql(
        "SELECT data->>'to', count(*), count(DISTINCT node_id) FROM inventory_nodeevent "
        "WHERE kind = 'state' AND data->>'to' IN ('unreachable', 'lost') GROUP BY 1"
    )
    got = {to: (k, nodes) for to, k, nodes in rows}
    return ", ".join(
        f"{to} {got.get(to, (0, 0))[0]:,} ({got.get(to, (0, 0))[1]:,} nodes)" for to in ("unreachable", "lost")
    )


def _silence(loop: Loop, dep: int, replicas: int, silent_n: int, timeout: float) -> str:
    """`silent_n` nodes hosting replicas go silent at once: the verdicts, and the replicas placed again."""
    victims = [
        r[0]
        for r in loop.sql(
            "SELECT s.node_id FROM placement_shard s JOIN placement_replica r ON r.id = s.replica_id "
            "WHERE r.deployment_id = %s AND r.state = 'ready' GROUP BY s.node_id ORDER BY s.node_id LIMIT %s",
            [dep, silent_n],
        )
    ]
    hosted = loop.sql(
        "SELECT count(DISTINCT s.replica_id) FROM placement_shard s "
        "JOIN placement_replica r ON r.id = s.replica_id "
        "WHERE r.deployment_id = %s AND r.state = 'ready' AND s.node_id = ANY(%s)",
        [dep, victims],
    )[0][0]
    loop.control.write_text(json.dumps({"silence": victims}))
    states = "SELECT count(*) FROM inventory_node WHERE id = ANY(%s) AND state = ANY(%s)"
    wait = float(loop.env["LLMGW_LOST_AFTER"]) * 3 + 60
    head = (
        f"{len(victims)} nodes silent at once ({hosted} replicas on them; unreachable after "
        f"{loop.env['LLMGW_UNREACHABLE_AFTER']} s, lost after {loop.env['LLMGW_LOST_AFTER']} s, sweep every "
        f"{loop.tick:g} s)"
    )
    try:
        unreach = loop.within(
            lambda: loop.sql(states, [victims, ["unreachable", "lost"]])[0][0] >= len(victims), loop.left(wait)
        )
        if unreach is None:
            return f"{head}: not all unreachable within the wait (or the budget was spent)"
        lost = loop.within(lambda: loop.sql(states, [victims, ["lost"]])[0][0] >= len(victims), loop.left(wait))
        if lost is None:
            return f"{head}: not all lost within the wait (or the budget was spent)"
        # A verdict is a state event (inventory/liveness.py); "lost" is no event kind of its own, and reading it
        # as one had the spread always 0.
        lost_events = (
            "FROM inventory_nodeevent e WHERE e.node_id = ANY(%s) AND e.kind = 'state' AND e.data->>'to' = 'lost'"
        )
        verdicts = loop.sql("SELECT min(e.at), max(e.at) " + lost_events, [victims])[0]
        # What the control plane owes is a verdict lost_after past each node's last renewal, within a sweep:
        # measured from the bench's silence it also holds the node's last interval and the simulator's
        # noticing the control file, neither of which the control plane chose.
        late = loop.sql(
            "SELECT min(extract(epoch FROM e.at - n.last_seen)), max(extract(epoch FROM e.at - n.last_seen)) "
            "FROM inventory_nodeevent e JOIN inventory_node n ON n.id = e.node_id "
            "WHERE e.node_id = ANY(%s) AND e.kind = 'state' AND e.data->>'to' = 'lost'",
            [victims],
        )[0]
        elsewhere = (
            "SELECT count(*) FROM placement_replica r WHERE r.deployment_id = %s AND r.state = 'ready' AND NOT EXISTS "
            "(SELECT 1 FROM placement_shard s WHERE s.replica_id = r.id AND s.node_id = ANY(%s))"
        )
        back = loop.within(lambda: loop.sql(elsewhere, [dep, victims])[0][0] >= replicas, loop.left(timeout))
        spread = (verdicts[1] - verdicts[0]).total_seconds() if verdicts[0] else 0.0
        tail = f"{back:.1f} s after" if back is not None else "not within the wait (or the budget) after"
        return (
            f"{head}: all unreachable {unreach:.1f} s after the silence, all lost {unreach + lost:.1f} s "
            f"(verdicts spread over {spread:.1f} s; each {float(late[0]):.1f}-{float(late[1]):.1f} s after its "
            f"node's last renewal), every replica ready elsewhere {tail} the last lost verdict was seen"
        )
    finally:
        loop.control.write_text("{}")


def _scrape(loop: Loop) -> Iterator[str]:
    """/metrics, BENCH_FLEET_SCRAPES times (once when the budget is spent); then the memory of every process."""
    times, size = [], 0
    for k in range(int(_env("BENCH_FLEET_SCRAPES", 3))):
        if k and loop.left(1) <= 0:
            break
        t0 = time.perf_counter()
        try:
            r = httpx.get(f"{loop.url}/metrics", headers={"Authorization": f"Bearer {loop.metrics_token}"},
                          timeout=max(30.0, loop.left(120)))  # fmt: skip
        except httpx.TimeoutException:
            yield f"/metrics: no answer within {time.perf_counter() - t0:.0f} s"
            break
        times.append(time.perf_counter() - t0)
        size = len(r.content)
        if r.status_code != 200:
            yield f"/metrics: HTTP {r.status_code}"
            break
    if times:
        yield (
            f"/metrics: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}, "
            f"{len(times)} scrapes), {size / 1e6:.1f} MB"
        )
    yield "  memory at the end: " + "; ".join(loop.memory())


def run() -> Iterator[str]:
    """Run the phases, yielding the lines to print as they come; every process started is stopped."""
    with tempfile.TemporaryDirectory(prefix="llmgw-fleet-") as tmp:
        loop = Loop(Path(tmp))
        try:
            loop.start_control_plane()
            yield from _phases(loop)
        except Exception:
            for name in ("server.log", "worker.log", "fleet-0.log"):
                path = Path(tmp) / name
                if path.exists():
                    print(f"--- {name}\n{path.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            loop.stop()
