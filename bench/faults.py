"""The fault suite: `python -m bench faults` (make faults) breaks a throwaway stack and says what was lost.

The stack is what `make run` starts (scripts/run-all.sh: the web server,
a Celery worker, Celery beat and the gateway, each started again when it
dies) on a PostgreSQL, a cache Redis and a broker Redis of its own (free
ports, temporary folders: never the machine's servers), with default
thresholds, a fleet of simulated nodes (real agent processes) and an echo
replica behind the gateway. Throughout every scenario a client sends chat
requests to the gateway and the database is watched for nodes leaving
ready. Each scenario prints one line: what was done, and what was lost
(target: nothing).

    python -m bench faults                  # every scenario
    python -m bench faults trickle redis    # some (by name; see SCENARIOS)

BENCH_FAULTS_NODES sets the fleet's size (default 6). The `web-outage-100`
scenario runs on a stack of its own with a fleet of BENCH_FAULTS_FLEET_NODES
(default 100): the web server stopped for 45 s, and with BENCH_FAULTS_LONG=1
for 6 minutes too (past the lost delay).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

from bench import procs
from bench.hostile import Trickle, request_head
from llmgw_sim.simulate import Fleet

REPO = Path(__file__).resolve().parents[1]
JOIN = "llmgw-join-fault-suite"
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int) -> int:
    """The first of `n` consecutive ports free now, below the ephemeral range."""
    for base in range(20000, 32000 - n, 97):
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def wait(cond: Callable[[], object], *, timeout: float, what: str) -> None:
    """Poll `cond` until true; RuntimeError naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(0.2)


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass
class Lost:
    """What a scenario cost: nodes that left ready, gateway requests that failed, of how many."""

    nodes: set[str] = field(default_factory=set)
    failed: int = 0
    requests: int = 0
    # Of the failed, those whose connection was refused (no server listening on the port).
    refused: int = 0

    def line(self, name: str, did: str) -> str:
        """The scenario's line in the table."""
        return (
            f"{name:<24} {did:<62} lost: {len(self.nodes)} nodes left ready, "
            f"{self.failed} of {self.requests} gateway requests failed ({self.refused} refused)"
        )


class Watch:
    """During a scenario: chat requests to the gateway (about 10 a second) and the nodes' states, polled."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lost = Lost()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._chat, daemon=True), threading.Thread(target=self._nodes)]

    def __enter__(self) -> Lost:
        for t in self.threads:
            t.start()
        return self.lost

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _chat(self) -> None:
        body = {"model": "faults", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {self.stack.key}"}
        with httpx.Client(base_url=self.stack.gateway, headers=headers, timeout=10) as http:
            while not self.stop.is_set():
                self.lost.requests += 1
                try:
                    ok = http.post("/v1/chat/completions", json=body).status_code == 200
                except httpx.ConnectError:
                    self.lost.refused += 1
                    ok = False
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    self.lost.failed += 1
                self.stop.wait(0.1)

    def _nodes(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                for node, state in self.stack.sql("SELECT id, state FROM inventory_node"):
                    if state != "ready":
                        self.lost.nodes.add(node)
            self.stop.wait(0.5)


class Stack:
    """The throwaway stack: own stores, run-all.sh, a simulated fleet, an echo replica and an API key."""

    def __init__(self, root: Path, *, nodes: int) -> None:
        self.root, self.n_nodes = root, nodes
        self.pg_port, self.cache_port, self.broker_port = free_port(), free_port(), free_port()
        self.web_port, self.gw_port = free_port(), free_port()
        self.web, self.gateway = f"http://127.0.0.1:{self.web_port}", f"http://127.0.0.1:{self.gw_port}"
        self.pg_url = f"postgres://postgres@127.0.0.1:{self.pg_port}/postgres"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "0",
            "SECRET_KEY": "llmgw-fault-suite",
            "DATABASE_URL": self.pg_url,
            "REDIS_URL": f"redis://127.0.0.1:{self.cache_port}/0",
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{self.broker_port}/0",
            "LLMGW_CACHE_PREFIX": "llmgw-faults",
            "LLMGW_VAR_DIR": str(root / "var"),
            "LLMGW_JOIN_TOKEN": JOIN,
            "LLMGW_LISTEN": f"127.0.0.1:{self.web_port}",
            "LLMGW_GATEWAY_LISTEN": f"127.0.0.1:{self.gw_port}",
            "WEB_CONCURRENCY": "2",
            "LLMGW_GATEWAY_WORKERS": "2",
            "LLMGW_WEB_LOG_LEVEL": "warning",
            # The simulated nodes share this machine: each shard a port of its own.
            "LLMGW_SHARD_PORTS_UNIQUE": "1",
            "LLMGW_SHARD_PORT_BASE": str(free_port_range(40)),
        }
        self.redis: dict[int, subprocess.Popen] = {}
        self.run_all: subprocess.Popen | None = None
        self.fleet = None
        self.key = ""

    # --- the stores

    def _redis(self, port: int) -> None:
        self.redis[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def _pg(self, *args: str) -> None:
        subprocess.run([*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(self.root / "pg"), *args],
                       check=True, capture_output=True)  # fmt: skip

    def sql(self, query: str) -> list[tuple]:
        """Rows of a query on the stack's database."""
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query).fetchall()

    def manage(self, code: str) -> str:
        """Python run in the stack's Django; its output."""
        out = subprocess.run([sys.executable, "manage.py", "shell", "-v", "0", "-c", code], cwd=REPO, env=self.env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return out.stdout

    def start(self) -> None:
        """Everything up, the fleet ready, the gateway routing to the echo replica."""
        pg = self.root / "pg"
        pg.mkdir()
        if os.geteuid() == 0:
            shutil.chown(pg, "postgres", "postgres")
        subprocess.run([*_as_postgres(), str(PG_BIN / "initdb"), "-D", str(pg), "-U", "postgres", "--auth=trust", "-N"],
                       check=True, capture_output=True)  # fmt: skip
        self._pg("-l", str(pg / "log"), "-o", f"-p {self.pg_port} -k {pg} -c listen_addresses=127.0.0.1 -c fsync=off",
                 "-w", "start")  # fmt: skip
        self._redis(self.cache_port)
        self._redis(self.broker_port)
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=REPO, env=self.env, check=True,
                       capture_output=True)  # fmt: skip
        log = open(self.root / "run-all.log", "wb")  # noqa: SIM115 - the child keeps it
        self.run_all = subprocess.Popen(
            ["scripts/run-all.sh"],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait(lambda: b"llmgw is up" in (self.root / "run-all.log").read_bytes(), timeout=180, what="the stack up")
        self.key = self.manage(
            "from django.contrib.auth import get_user_model\n"
            "from django.utils import timezone\n"
            "from gateway import keys\n"
            "from placement.models import Deployment, EngineProfile\n"
            "p = EngineProfile.objects.create(name='echo-faults', engine='echo', gpus_per_node=4,"
            " args=['--load-seconds', '0.1'], startup_timeout_s=60)\n"
            "Deployment.objects.create(name='faults', served_model='faults', profile=p, replicas=2)\n"
            "u = get_user_model().objects.create_user('faults')\n"
            "print(keys.create_key(name='faults', owner=u, now=timezone.now())[1])\n"
        ).strip()
        self.fleet = Fleet(nodes=self.n_nodes, control_plane=self.web, join_token=JOIN, workdir=self.root / "fleet",
                           profiles=["hgx-h100"])  # fmt: skip
        self.fleet.start()
        wait(lambda: [s for (s,) in self.sql("SELECT state FROM inventory_node")] == ["ready"] * self.n_nodes,
             timeout=max(120, 3 * self.n_nodes), what="the fleet ready")  # fmt: skip
        wait(self.gateway_answers, timeout=180, what="the gateway routing to the echo replicas")

    def gateway_answers(self) -> bool:
        """Whether a chat request through the gateway succeeds now."""
        body = {"model": "faults", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        try:
            r = httpx.post(f"{self.gateway}/v1/chat/completions", json=body, timeout=5,
                           headers={"Authorization": f"Bearer {self.key}"})  # fmt: skip
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def web_answers(self) -> bool:
        """Whether the admin's login page answers now."""
        try:
            return httpx.get(f"{self.web}/admin/login/", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """Stop everything the stack started."""
        if self.fleet is not None:
            self.fleet.stop(grace_s=5)
        if self.run_all is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.run_all.pid, signal.SIGCONT)
                os.killpg(self.run_all.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run_all.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.run_all.pid, signal.SIGKILL)
        for proc in self.redis.values():
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(subprocess.CalledProcessError):
            self._pg("-m", "immediate", "-w", "stop")


# --- the scenarios: each does its harm under a Watch and returns what it did

# Process kinds: (name, what their command line holds, only the leaves (workers), how to see them back).
KINDS = [
    ("web worker", "llmgw.web:app", True),
    ("web master", "llmgw.web:app", False),
    ("gateway worker", procs.gateway_needle(), True),
    ("gateway master", procs.gateway_needle(), False),
    ("Celery worker", "worker --loglevel", False),
    ("Celery beat", "beat --loglevel", False),
]


def victim(pids: list[int], leaves: list[int], *, leaf: bool, parents: dict[int, int]) -> int:
    """The process to kill among those of a kind: a worker (a leaf), or the workers' parent (the master).

    `parents` maps each pid to its parent's. Above a server's master is the
    process that holds its socket (llmgw/listen.py), whose command line names
    the application too: the master is the one the workers were started by.
    """
    masters = sorted({parents[p] for p in leaves if parents.get(p) in pids})
    pool = leaves if leaf else masters or [p for p in pids if p not in leaves] or pids
    if not pool:
        raise RuntimeError("no such process")
    return pool[0]


def kill_each_kind(stack: Stack) -> list[tuple[str, str, Lost]]:
    """SIGKILL each process kind in turn, under load; wait until it is replaced and the stack answers."""
    out = []
    root = stack.run_all.pid
    for name, needle, leaf in KINDS:
        with Watch(stack) as lost:
            time.sleep(3)
            pids, leaves = procs.find(root, needle), procs.find(root, needle, leaf=True)
            pid = victim(pids, leaves, leaf=leaf, parents={p: procs.parent(p) for p in pids})
            os.kill(pid, signal.SIGKILL)
            started = time.monotonic()
            wait(lambda: pid not in procs.find(root, needle) and len(procs.find(root, needle)) >= len(pids),  # noqa: B023
                 timeout=120, what=f"a new {name}")  # fmt: skip
            wait(lambda: stack.web_answers() and stack.gateway_answers(), timeout=120, what="the stack answering")
            took = time.monotonic() - started
            time.sleep(5)
        out.append((f"kill {name}", f"SIGKILL one {name} under load; replaced in {took:.0f} s", lost))
    return out


def trickle(stack: Stack) -> list[tuple[str, str, Lost]]:
    """100 trickled bodies at the web server and 100 at the gateway, until both cut them all off."""
    web_head = request_head("/api/v1/agent/heartbeat", headers={"Authorization": "Bearer llmgw-node-forged"})
    gw_head = request_head("/v1/chat/completions", headers={"Authorization": f"Bearer {stack.key}"})
    with Watch(stack) as lost:
        web = Trickle("127.0.0.1", stack.web_port, web_head, n=100).start()
        gw = Trickle("127.0.0.1", stack.gw_port, gw_head, n=100).start()
        try:
            wait(lambda: web.open() == 0 and gw.open() == 0, timeout=120, what="the trickles cut off")
        finally:
            web.stop()
            gw.stop()
        # A web server that held a thread per trickle would have starved the heartbeats meanwhile.
        time.sleep(5)
    did = (f"100+100 trickled bodies (web, gateway); cut off in {max(web.held_s(), gw.held_s()):.0f} s, "
           f"answers {sorted({**web.statuses(), **gw.statuses()})}")  # fmt: skip
    return [("trickled bodies", did, lost)]


def web_outage(stack: Stack, seconds: float = 45.0) -> list[tuple[str, str, Lost]]:
    """The web server stopped (SIGSTOP: its sockets open, nothing answered) for `seconds`, then resumed."""
    root = stack.run_all.pid
    frozen = procs.find(root, "llmgw.web:app")
    with Watch(stack) as lost:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        wait(stack.web_answers, timeout=60, what="the web server answering")
        # Every node heartbeats again, and the sweeps after the outage have judged.
        time.sleep(15)
    return [(f"web outage {seconds:.0f} s", f"web server stopped (SIGSTOP) for {seconds:.0f} s, then resumed", lost)]


def redis_outage(stack: Stack, seconds: float = 20.0) -> list[tuple[str, str, Lost]]:
    """The cache Redis killed for `seconds`, then started again (empty)."""
    with Watch(stack) as lost:
        proc = stack.redis.pop(stack.cache_port)
        proc.kill()
        proc.wait(10)
        time.sleep(seconds)
        stack._redis(stack.cache_port)
        wait(stack.gateway_answers, timeout=60, what="the gateway answering")
        time.sleep(10)
    return [
        (f"cache Redis outage {seconds:.0f} s", f"cache Redis killed for {seconds:.0f} s, started again empty", lost)
    ]


def web_outage_fleet(stack: Stack) -> list[tuple[str, str, Lost]]:
    """The web outage on a full-sized fleet: 45 s, and 6 minutes with BENCH_FAULTS_LONG=1."""
    out = web_outage(stack, 45.0)
    if os.environ.get("BENCH_FAULTS_LONG", "") == "1":
        out += web_outage(stack, 360.0)
    return [(f"{label}, {stack.n_nodes} nodes", did, lost) for label, did, lost in out]


SCENARIOS: dict[str, Callable[[Stack], list[tuple[str, str, Lost]]]] = {
    "trickle": trickle,
    "kill": kill_each_kind,
    "web-outage": web_outage,
    "redis": redis_outage,
    "web-outage-100": web_outage_fleet,
}
# Scenarios that need a fleet of their own size, each on a stack of its own.
FLEET_SCENARIOS = {"web-outage-100"}


def lines(names: list[str] | None = None) -> Iterator[str]:
    """Run the named scenarios (all by default) on fresh stacks; one line each, as each ends."""
    unknown = [n for n in names or [] if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    if PG_BIN is None or shutil.which("redis-server") is None:
        raise SystemExit("the fault suite needs PostgreSQL's server binaries and redis-server")
    chosen = names or list(SCENARIOS)
    small = [n for n in chosen if n not in FLEET_SCENARIOS]
    if small:
        yield from _on_a_stack(small, nodes=int(os.environ.get("BENCH_FAULTS_NODES", "6")))
    for name in chosen:
        if name in FLEET_SCENARIOS:
            yield from _on_a_stack([name], nodes=int(os.environ.get("BENCH_FAULTS_FLEET_NODES", "100")))


def _on_a_stack(names: list[str], *, nodes: int) -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-faults-"))
    os.chmod(root, 0o755)
    stack = Stack(root, nodes=nodes)
    try:
        stack.start()
        yield f"stack: {stack.n_nodes} simulated nodes, default thresholds, 2 web and 2 gateway workers"
        for name in names:
            for label, did, lost in SCENARIOS[name](stack):
                yield lost.line(label, did)
    except Exception as exc:  # the stack's own failure: said, with where its logs are (kept)
        yield f"the suite stopped: {exc} (logs in {root})"
        return
    finally:
        stack.close()
    shutil.rmtree(root, ignore_errors=True)


def run(names: list[str] | None = None) -> list[str]:
    """The lines of every scenario (bench's interface)."""
    return list(lines(names))


def main(argv: list[str]) -> int:
    """`python -m bench faults [NAME ...]`: each line printed as its scenario ends."""
    for line in lines(argv or None):
        print(f"   {line}", flush=True)
    return 0
