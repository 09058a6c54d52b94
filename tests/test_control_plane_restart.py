"""End to end: the control plane restarts, as a real process, without restarting any shard.

The control plane runs as its own gunicorn process on the test database and
cache; three real node agents (fixture mode, the shipped hgx-h100 profile)
talk HTTP to it and run real echo shards. The test drives the reconciler
itself (the task function, as beat would), kills the control plane with
SIGTERM, and starts a new one on the same port. The agents never stop: they
back off while it is away and heartbeat to the new process. Nothing that runs
is restarted, and a shard the new control plane does not know is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from django.core.cache import cache
from django.db import connection
from django.utils import timezone

from inventory import liveness
from inventory.models import Allocation, Command, Node, NodeEvent
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[1]
JOIN = "llmgw-join-control-plane-restart-test"
HEARTBEAT_S = 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, *, timeout: float, what: str, each=None):
    """Poll cond until it returns something truthy; fail with `what()` after the deadline."""
    end = time.monotonic() + timeout
    while True:
        if each is not None:
            each()
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"not reached in {timeout:g}s: {what()}")
        time.sleep(0.1)


def _database_url() -> str:
    """The test database (the one pytest-django created) as a DATABASE_URL."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or "5432"
    return f"postgres://{auth}@{host}:{port}/{s['NAME']}"


def _kill_group(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM a process started in its own session, SIGKILL its group after the grace period."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class ControlPlane:
    """The control plane as a separate gunicorn process, restartable on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "control-plane.log"
        self.proc: subprocess.Popen | None = None
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "0",
            "DATABASE_URL": _database_url(),
            "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"),
            "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw-test"),
            "SECRET_KEY": os.environ.get("SECRET_KEY", "llmgw-test-key"),
            "CELERY_BROKER_URL": "memory://",
            "LLMGW_JOIN_TOKEN": JOIN,
            # Agents take the longer of their own interval and this one.
            "LLMGW_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
            "LOG_LEVEL": "WARNING",
        }

    def start(self) -> None:
        """Start gunicorn and wait until it answers HTTP."""
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "llmgw.wsgi",
                    "--bind",
                    f"127.0.0.1:{self.port}",
                    "--workers",
                    "1",
                    "--threads",
                    "4",
                    "--graceful-timeout",
                    "5",
                ],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        def answers() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"the control plane exited with {self.proc.returncode}: {self.tail()}")
            try:
                return httpx.get(f"{self.url}/metrics", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(answers, timeout=30, what=self.tail)

    def stop(self) -> None:
        """SIGTERM to the master, as an orchestrator stops it; wait until it has exited and the port is closed."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the control plane did not exit on SIGTERM: {self.tail()}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # nothing of it may linger
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{self.url}/metrics", timeout=1)

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"


class Agents:
    """Real agent processes for simulated nodes; their shards are found through the agents' state records."""

    def __init__(self, url: str, workdir: Path, n: int) -> None:
        from llmgw_sim.simulate import Fleet

        self.fleet = Fleet(
            nodes=n,
            control_plane=url,
            join_token=JOIN,
            workdir=workdir,
            profiles=["hgx-h100"],
            heartbeat_interval=HEARTBEAT_S,
        )
        self.seen: dict[int, int] = {}  # pid -> process start, of every shard ever seen

    def start(self) -> None:
        self.fleet.start()

    def shards(self) -> dict[str, int]:
        """Shard id -> pid of each shard process that runs now, read from the agents' records."""
        from llmgw_agent.supervisor import proc_identity

        out = {}
        for n in self.fleet.nodes:
            for rec in (n.dir / "state" / "shards").glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    data = json.loads(rec.read_text())
                    pid, start = data.get("pid"), data.get("proc_start")
                    if not pid:
                        continue
                    self.seen[pid] = start
                    ident = proc_identity(pid)
                    if ident and ident[0] == start:
                        out[data["shard_id"]] = pid
        return out

    def running(self, pid: int) -> bool:
        """Whether the shard process seen with this pid still runs (not merely a pid reused)."""
        from llmgw_agent.supervisor import proc_identity

        ident = proc_identity(pid)
        return ident is not None and ident[0] == self.seen.get(pid)

    def check_alive(self) -> None:
        for n in self.fleet.nodes:
            if n.proc is not None and n.proc.poll() is not None:
                pytest.fail(f"agent {n.node_id} exited: {self.log(n.node_id)}")

    def retries(self) -> dict[str, int]:
        """Node id -> how many times its agent has found the control plane unreachable."""
        return {
            n.node_id: (n.dir / "agent.log").read_text(errors="replace").count("retrying in") for n in self.fleet.nodes
        }

    def logs(self) -> str:
        return "\n".join(f"--- {n.node_id}\n{self.log(n.node_id)[-1000:]}" for n in self.fleet.nodes)

    def log(self, node_id: str) -> str:
        n = next(n for n in self.fleet.nodes if n.node_id == node_id)
        return (n.dir / "agent.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        """Agents first (SIGTERM, then SIGKILL), then every shard process group still running."""

        self.shards()
        self.fleet.stop(grace_s=5)
        for n in self.fleet.nodes:
            if n.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(n.proc.pid, signal.SIGKILL)
        for pid in self.seen:
            if self.running(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def plane(transactional_db, tmp_path):
    cp = ControlPlane(tmp_path)
    try:
        yield cp
    finally:
        if cp.proc is not None:
            _kill_group(cp.proc, grace_s=5)


@pytest.fixture
def agents(plane, tmp_path):
    pytest.importorskip("llmgw_agent.discovery")
    a = Agents(plane.url, tmp_path / "fleet", 3)
    try:
        yield a
    finally:
        a.close()


def reconcile() -> None:
    """One pass of the reconciler and the liveness sweep, as beat runs them."""
    from placement.tasks import reconcile_task

    now = timezone.now()
    reconcile_task(now=now)
    liveness.sweep(now=now)


def summary() -> str:
    reps = "; ".join(
        f"{r.deployment.name}/{r.state}:{r.reason}:{[(s.node_id, s.state) for s in r.shards.all()]}"
        for r in Replica.objects.select_related("deployment").prefetch_related("shards")
    )
    nodes = ", ".join(f"{n.id}={n.state}@{n.last_seen:%H:%M:%S.%f}" for n in Node.objects.all())
    return f"replicas: {reps}; nodes: {nodes}"


def chat(endpoint: str, model: str) -> str:
    r = httpx.post(
        f"{endpoint}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "still here"}]},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_control_plane_restart_keeps_shards_and_fences_unknown_ones(plane, agents, settings):
    # The reconciler runs in this process. Three nodes share this host's address: their shard
    # ports are kept apart without LLMGW_SHARD_PORTS_UNIQUE, as in `make demo`.
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    # A shard whose port a stranger took meanwhile is placed again within the second here.
    settings.LLMGW_START_BACKOFF_BASE = 0.2
    plane.start()
    agents.start()
    _wait(
        lambda: Node.objects.filter(state="ready").count() == 3,
        timeout=30,
        what=lambda: f"{summary()}; {plane.tail()}; {agents.logs()}",
        each=agents.check_alive,
    )

    prof = EngineProfile.objects.create(
        name="echo-8", engine="echo", gpus_per_node=8, args=["--load-seconds", "0.1"], startup_timeout_s=60
    )
    keep = Deployment.objects.create(name="keep", served_model="echo-keep", profile=prof, replicas=2)
    gone = Deployment.objects.create(name="gone", served_model="echo-gone", profile=prof, replicas=1)
    _wait(
        lambda: Replica.objects.filter(state="ready").count() == 3,
        timeout=30,
        what=lambda: f"{summary()}; {agents.logs()}",
        each=lambda: (agents.check_alive(), reconcile()),
    )
    kept = {r.id: r for r in Replica.objects.filter(deployment=keep)}
    for rep in kept.values():
        assert chat(rep.endpoint, "echo-keep") == "still here"
    doomed = Replica.objects.get(deployment=gone)
    assert chat(doomed.endpoint, "echo-gone") == "still here"
    doomed_shard, doomed_node = (str(v) for v in doomed.shards.values_list("id", "node_id").get())

    # The agents' records of the three running shards, read once and kept: reading them again
    # later could see a shard between its records, and is a moment, not the condition.
    placed = {str(s) for s in Shard.objects.values_list("id", flat=True)}
    assert len(placed) == 3

    def all_placed_run() -> dict[str, int] | None:
        running = agents.shards()
        return running if set(running) == placed else None

    pids = _wait(
        all_placed_run,
        timeout=10,
        what=lambda: f"{summary()}; running {agents.shards()}; {agents.logs()}",
    )
    starts = Command.objects.filter(kind="start_shard").count()
    assert starts == 3

    # The control plane goes away. While it is down its database is restored from
    # a backup taken before "gone" was deployed: that shard is unknown to it now.
    plane.stop()
    down_at = timezone.now()
    # The models keep serving without it.
    for rep in kept.values():
        assert chat(rep.endpoint, "echo-keep") == "still here"
    Allocation.objects.filter(replica_id=doomed.id).delete()
    gone.delete()
    assert not Shard.objects.filter(id=doomed_shard).exists()
    # Momentary telemetry does not survive either.
    cache.clear()
    # Every agent meets the closed port (and backs off; it keeps its shards).
    before = agents.retries()
    _wait(
        lambda: all(n > before[k] for k, n in agents.retries().items()),
        timeout=15,
        what=agents.logs,
        each=agents.check_alive,
    )
    plane.start()

    # Every agent heartbeats to the new process, with its shards as they run.
    # (They back off with jitter, doubling up to a minute: allow for a slow start of the new process.)
    _wait(
        lambda: Node.objects.filter(state="ready", last_seen__gt=down_at).count() == 3,
        timeout=60,
        what=lambda: f"{summary()}; {plane.tail()}; {agents.logs()}",
        each=agents.check_alive,
    )
    # The unknown shard is fenced: a StopShard, delivered and acknowledged, and its process ends.
    stop = _wait(
        lambda: Command.objects.filter(kind="stop_shard", shard_id=doomed_shard, acked_at__isnull=False).first(),
        timeout=20,
        what=lambda: f"{summary()}; commands {list(Command.objects.values_list('kind', 'shard_id', 'acked_at'))}",
        each=reconcile,
    )
    assert stop.node_id == doomed_node
    _wait(lambda: doomed_shard not in agents.shards(), timeout=20, what=lambda: agents.log(doomed_node))
    assert not agents.running(pids[doomed_shard])

    # Several passes of the reconciler and heartbeats from every agent later, nothing else moved.
    mark = timezone.now()
    _wait(
        lambda: Node.objects.filter(last_seen__gt=mark).count() == 3,
        timeout=10,
        what=summary,
        each=reconcile,
    )
    reconcile()
    survivors = {sid: pid for sid, pid in pids.items() if sid != doomed_shard}
    assert agents.shards() == survivors
    assert Command.objects.filter(kind="start_shard").count() == starts
    assert Command.objects.filter(kind="stop_shard").count() == 1
    assert {r.id: r.state for r in Replica.objects.filter(deployment=keep)} == dict.fromkeys(kept, "ready")
    assert {r.id: r.ready_at for r in Replica.objects.filter(deployment=keep)} == {
        rid: r.ready_at for rid, r in kept.items()
    }
    assert set(Shard.objects.values_list("state", flat=True)) == {"ready"}
    assert not PlacementEvent.objects.filter(replica_id__in=list(kept), at__gt=down_at).exists()
    # The nodes carried on as they were: no state change, no event.
    assert set(Node.objects.values_list("state", flat=True)) == {"ready"}
    assert list(NodeEvent.objects.filter(at__gt=down_at).values_list("node_id", "kind", "message")) == []
    for rep in kept.values():
        assert chat(rep.endpoint, "echo-keep") == "still here"
