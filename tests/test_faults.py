"""The control plane's own faults never take the fleet down: proved on real processes.

A PostgreSQL and a Redis of the suite's own (their own data directory and
free port, started and stopped here: never the machine's shared servers), a
real gunicorn control plane, a Celery worker with its beat, and three real
node agents (fixture mode) running echo shards. Short thresholds, so an
outage longer than the lost delay takes seconds. The tests run in order on
one cluster, each asserting exact outcomes:

- the database is stopped for longer than LLMGW_LOST_AFTER: no node is lost,
  no shard stopped, no replica moved;
- Redis is stopped for longer than LLMGW_UNREACHABLE_AFTER: every heartbeat
  still renews its lease;
- a second beat and three reconcilers race a scale-up: the desired count is
  exact, no GPU or port is held twice, the second beat sends nothing;
- the holder of the reconcile lock is killed with SIGKILL mid-pass: the next
  pass runs at once;
- a poison profile beside a good deployment: the good one is placed;
- a join whose answer was lost, retried: the node joins;
- cordon then uncordon of a silent node: refused, and nothing is placed on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from placement.queueing import TASK_NAME as RECONCILE_TASK
from tests.ports import free_port_range
from tests.test_control_plane_restart import _wait

# One cluster for the whole module, its tests in order: under `pytest -n` they all go to one worker
# (--dist loadgroup), which starts the cluster once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("faults")]

REPO = Path(__file__).resolve().parents[1]
JOIN = "llmgw-join-fault-suite-token"
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)
HEARTBEAT_S = 0.3
UNREACHABLE_S = 6
LOST_S = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres() -> list[str]:
    # PostgreSQL refuses to run as root: run its tools as the postgres user then.
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class OwnPostgres:
    """A PostgreSQL server of the suite's own, on a temporary data directory and a free port."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "pg"
        self.port = _free_port()
        self.log = root / "pg.log"
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        self.dir.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self.log.touch()
            shutil.chown(self.log, "postgres", "postgres")
        subprocess.run(
            [*_as_postgres(), str(PG_BIN / "initdb"), "-D", str(self.dir), "-U", "postgres", "--auth=trust", "-N"],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [
                *_as_postgres(),
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.dir),
                "-l",
                str(self.log),
                "-o",
                opts,
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        subprocess.run(
            [*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-m", "fast", "-w", "stop"],
            check=False,
            capture_output=True,
        )

    def sql(self, query: str, params: list | tuple = ()) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []


class OwnRedis:
    """A Redis server of the suite's own, in memory, on a free port."""

    def __init__(self, root: Path) -> None:
        self.port = _free_port()
        self.root = root
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        def answers() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
            return False

        _wait(answers, timeout=10, what=lambda: "redis did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _kill_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, grace_s: float = 5) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class Cluster:
    """The stores, the control plane (web, worker with beat) and three agents."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pg = OwnPostgres(root)
        self.redis = OwnRedis(root)
        # The broker on a Redis of its own, so that stopping the cache is a cache outage only.
        self.broker = OwnRedis(root)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "0",
            "SECRET_KEY": "llmgw-fault-suite-key",
            "DATABASE_URL": self.pg.url,
            "REDIS_URL": f"redis://127.0.0.1:{self.redis.port}/0",
            "LLMGW_CACHE_PREFIX": "llmgw-faults",
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{self.broker.port}/0",
            "LLMGW_VAR_DIR": str(root / "var"),
            "LLMGW_JOIN_TOKEN": JOIN,
            "LLMGW_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
            "LLMGW_UNREACHABLE_AFTER": str(UNREACHABLE_S),
            "LLMGW_LOST_AFTER": str(LOST_S),
            "LLMGW_LIVENESS_INTERVAL": "1",
            "LLMGW_RECONCILE_INTERVAL": "1",
            "LLMGW_SHARD_PORTS_UNIQUE": "1",
            "LLMGW_SHARD_PORT_BASE": str(free_port_range(40)),
            # A shard that fails to start (a port taken by a stranger) is retried within seconds here.
            "LLMGW_START_BACKOFF_BASE": "1",
            # Beat's "Sending due task" lines are routine (DEBUG): the two-beats test reads them.
            "LOG_LEVEL": "DEBUG",
        }
        for d in ("celery/broker", "celery/processed", "celery/control"):
            (root / "var" / d).mkdir(parents=True, exist_ok=True)
        self.fleet = None

    # --- processes

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def manage(self, code: str, *, timeout: float = 120) -> str:
        """Run Python in the control plane's Django (manage.py shell -c); returns its output."""
        out = subprocess.run(
            [sys.executable, "manage.py", "shell", "-v", "0", "-c", code],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def log(self, name: str) -> str:
        """A process's whole log."""
        with contextlib.suppress(OSError):
            return (self.root / f"{name}.log").read_text(errors="replace")
        return "(no log)"

    def tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
        return "(no log)"

    def start(self) -> None:
        from llmgw_sim.simulate import Fleet

        self.pg.init()
        self.pg.start()
        self.redis.start()
        self.broker.start()
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=REPO,
            env=self.env,
            check=True,
            capture_output=True,
        )
        self.spawn(
            "web",
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
                "8",
                "--graceful-timeout",
                "5",
            ],
        )
        self.spawn(
            "worker",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "llmgw",
                "worker",
                "-B",
                "--loglevel=DEBUG",
                "--concurrency=2",
                "-s",
                str(self.root / "var" / "celery" / "beat-schedule"),
            ],
        )

        def answers() -> bool:
            if self.procs["web"].poll() is not None:
                pytest.fail(f"the control plane exited: {self.tail('web')}")
            try:
                return httpx.get(f"{self.url}/metrics", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(answers, timeout=60, what=lambda: self.tail("web"))
        self.fleet = Fleet(
            nodes=3,
            control_plane=self.url,
            join_token=JOIN,
            workdir=self.root / "fleet",
            profiles=["hgx-h100"],
            heartbeat_interval=HEARTBEAT_S,
        )
        self.fleet.start()

    def close(self) -> None:
        if self.fleet is not None:
            for n in self.fleet.nodes:
                if n.proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(n.proc.pid, signal.SIGCONT)
            self.fleet.stop(grace_s=5)
        for proc in self.procs.values():
            _kill_group(proc)
        self.redis.stop()
        self.broker.stop()
        self.pg.stop()

    # --- what the database says

    def nodes(self) -> dict[str, tuple[str, object]]:
        return {r[0]: (r[1], r[2]) for r in self.pg.sql("SELECT id, state, last_seen FROM inventory_node")}

    def replicas(self, deployment: str) -> dict[str, str]:
        rows = self.pg.sql(
            "SELECT r.id::text, r.state FROM placement_replica r JOIN placement_deployment d ON d.id = r.deployment_id "
            "WHERE d.name = %s",
            [deployment],
        )
        return dict(rows)

    def swept_since(self, at, *, seconds: float) -> bool:
        """Whether a liveness sweep has run `seconds` after `at` (a database time)."""
        rows = self.pg.sql(
            "SELECT last_sweep_at > %s + make_interval(secs => %s) FROM inventory_livenessclock", [at, seconds]
        )
        return bool(rows and rows[0][0])

    def live_shards(self) -> list[tuple[str, int]]:
        return self.pg.sql(
            "SELECT node_id, http_port FROM placement_shard WHERE state NOT IN ('stopped', 'failed') ORDER BY 1, 2"
        )

    def summary(self) -> str:
        try:
            reps = self.pg.sql(
                "SELECT d.name, r.state, r.reason FROM placement_replica r "
                "JOIN placement_deployment d ON d.id = r.deployment_id ORDER BY d.name"
            )
            return f"nodes {self.nodes()}; replicas {reps}"
        except psycopg.Error as exc:
            return f"(database: {exc})"


@pytest.fixture(scope="module")
def cluster():
    if PG_BIN is None or shutil.which("redis-server") is None:
        pytest.skip("needs PostgreSQL's server binaries and redis-server")
    pytest.importorskip("llmgw_agent.discovery")
    root = Path(tempfile.mkdtemp(prefix="llmgw-faults-"))
    os.chmod(root, 0o755)
    c = Cluster(root)
    try:
        c.start()
        _wait(
            lambda: [s for s, _ in c.nodes().values()] == ["ready"] * 3,
            timeout=60,
            what=lambda: f"{c.summary()}; {c.tail('web')}",
        )
        c.manage(
            "from placement.models import EngineProfile, Deployment\n"
            "p = EngineProfile.objects.create(name='echo-4', engine='echo', gpus_per_node=4,"
            " args=['--load-seconds', '0.1'], startup_timeout_s=60)\n"
            "Deployment.objects.create(name='steady', served_model='steady', profile=p, replicas=3)\n"
        )
        _wait(
            lambda: sorted(c.replicas("steady").values()) == ["ready"] * 3,
            timeout=90,
            what=lambda: f"{c.summary()}; {c.tail('worker')}",
        )
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


def _stable(c: Cluster) -> tuple[dict, list, int]:
    return (
        c.replicas("steady"),
        c.live_shards(),
        c.pg.sql("SELECT count(*) FROM agents_command WHERE kind = 'stop_shard'")[0][0],
    )


def test_a_database_outage_longer_than_the_lost_delay_loses_no_node(cluster):
    c = cluster
    replicas, shards, stops = _stable(c)
    c.pg.stop()
    end = time.monotonic() + LOST_S + 3
    # The outage lasts past the lost delay, whatever else happens meanwhile.
    _wait(lambda: time.monotonic() > end, timeout=LOST_S + 10, what=lambda: "outage")
    c.pg.start()
    back = c.pg.sql("SELECT now()")[0][0]
    # Every agent comes back within seconds, and the sweep runs again after them.
    _wait(lambda: all(seen > back for _, seen in c.nodes().values()), timeout=20, what=c.summary)
    _wait(
        lambda: c.swept_since(back, seconds=3),
        timeout=30,
        what=lambda: f"{c.summary()}; {c.tail('worker')}",
    )
    assert [s for s, _ in c.nodes().values()].count("lost") == 0
    assert _stable(c) == (replicas, shards, stops)
    # The sweep said why it judged nobody on that silence.
    kinds = [k for (k,) in c.pg.sql("SELECT kind FROM inventory_controlplaneevent")]
    assert "blind" in kinds, (kinds, c.tail("worker"))


def test_a_cache_outage_fails_no_heartbeat(cluster):
    c = cluster
    replicas, shards, stops = _stable(c)
    c.redis.stop()
    start = c.pg.sql("SELECT now()")[0][0]
    end = time.monotonic() + UNREACHABLE_S + 2
    _wait(lambda: time.monotonic() > end, timeout=UNREACHABLE_S + 10, what=lambda: "outage")
    # During the outage every lease was renewed, and no node left ready.
    during = c.pg.sql("SELECT now()")[0][0]
    nodes = c.nodes()
    assert all(state == "ready" and seen > start for state, seen in nodes.values()), nodes
    assert all((during - seen).total_seconds() < 2 for _, seen in nodes.values()), nodes
    c.redis.start()
    assert _stable(c) == (replicas, shards, stops)
    metrics = httpx.get(f"{c.url}/metrics", timeout=10).text
    assert 'llmgw_telemetry_cache_errors_total{op="put"}' in metrics


def test_two_beats_and_three_reconcilers_place_exactly(cluster):
    c = cluster
    second = c.spawn(
        "beat-2",
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "llmgw",
            "beat",
            "--loglevel=DEBUG",
            "-s",
            str(c.root / "beat-2-schedule"),
        ],
    )
    c.manage("from placement.models import Deployment\nDeployment.objects.filter(name='steady').update(replicas=5)\n")
    racers = [
        subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "shell",
                "-v",
                "0",
                "-c",
                "from placement.reconciler import reconcile\n"
                "from django.utils import timezone\n"
                "reconcile(now=timezone.now())\n",
            ],
            cwd=REPO,
            env=c.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for r in racers:
        _, err = r.communicate(timeout=120)
        assert r.returncode == 0, err[-2000:]
    _wait(lambda: sorted(c.replicas("steady").values()) == ["ready"] * 5, timeout=60, what=c.summary)
    live = c.live_shards()
    assert len(live) == len(set(live)) == 5
    gpus = c.pg.sql("SELECT node_id, gpu_index FROM inventory_allocatedgpu")
    assert len(gpus) == len(set(gpus)) == 20
    assert second.poll() is None, c.tail("beat-2")
    assert "Sending due task" not in c.log("beat-2")
    assert "Sending due task" in c.log("worker")
    _kill_group(second)


def test_a_killed_reconcile_holder_blocks_the_next_pass_for_no_time(cluster):
    c = cluster
    holder = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-v",
            "0",
            "-c",
            "import time\nfrom llmgw import locks\n"
            "while True:\n"
            "    with locks.single_flight('reconcile') as held:\n"
            "        if held:\n"
            "            print('held', flush=True)\n"
            "            time.sleep(120)\n"
            "    time.sleep(0.05)\n",
        ],
        cwd=REPO,
        env=c.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        # While it holds the lock (a pass in progress), another pass is redundant and skipped.
        assert "skipped" in c.manage(
            "from placement.tasks import reconcile_task\nprint('skipped' if reconcile_task() is None else 'ran')\n"
        )
    finally:
        killed_at = len(c.log("worker"))
        _kill_group(holder, signal.SIGKILL)
    # SIGKILL mid-pass: the database drops the lock with the session, and the next pass runs. Whose pass
    # does not matter: the cluster's own worker runs one a second (beat), and on a loaded machine its
    # passes can hold the lock at every moment this test's own call looks, which proves nothing amiss.
    ran = re.compile(rf"Task {re.escape(RECONCILE_TASK)}\[[^\]]+\] succeeded in [0-9.]+s: \{{")
    _wait(
        lambda: (
            ran.search(c.log("worker"), killed_at) is not None
            or "ran"
            in c.manage(
                "from placement.tasks import reconcile_task\nprint('skipped' if reconcile_task() is None else 'ran')\n"
            )
        ),
        timeout=15,
        what=c.summary,
    )


def test_a_poison_profile_does_not_block_a_good_deployment(cluster):
    c = cluster
    # Room for both, so the bad one is planned and its placement written (and raises) whatever the order. Its one
    # arg is longer than the wire allows (4,096): the database counts the args, not their length.
    c.manage("from placement.models import Deployment\nDeployment.objects.filter(name='steady').update(replicas=4)\n")
    _wait(
        lambda: c.pg.sql("SELECT count(*) FROM inventory_allocatedgpu")[0][0] == 16,
        timeout=60,
        what=c.summary,
    )
    c.manage(
        "from placement.models import EngineProfile, Deployment\n"
        "bad = EngineProfile.objects.create(name='poison', engine='echo', gpus_per_node=4, args=['x' * 5000])\n"
        "Deployment.objects.create(name='bad', served_model='bad', profile=bad, replicas=1)\n"
        "p = EngineProfile.objects.get(name='echo-4')\n"
        "Deployment.objects.create(name='good', served_model='good', profile=p, replicas=1)\n"
    )
    _wait(lambda: list(c.replicas("good").values()) == ["ready"], timeout=60, what=c.summary)
    # The bad one's placement raised, was recorded on its replica, and the pass went on.
    reasons = c.pg.sql(
        "SELECT e.reason FROM placement_placementevent e JOIN placement_deployment d ON d.id = e.deployment_id "
        "WHERE d.name = 'bad' AND e.kind = 'placement_error'"
    )
    assert reasons and all(r.startswith("placement failed (ValidationError") for (r,) in reasons), reasons
    c.manage("from placement.models import Deployment\nDeployment.objects.filter(name__in=['bad', 'good']).delete()\n")


def test_a_join_whose_answer_was_lost_is_retried_and_joins(cluster):
    c = cluster
    body = {"node_id": "retry-node", "hostname": "retry-node", "join_nonce": "r" * 43}
    headers = {"Authorization": f"Bearer {JOIN}"}
    first = httpx.post(f"{c.url}/api/v1/agent/register", json=body, headers=headers, timeout=30)
    assert first.status_code == 200
    # The answer was lost on the way; the agent sends the same join again.
    retry = httpx.post(f"{c.url}/api/v1/agent/register", json=body, headers=headers, timeout=30)
    assert retry.status_code == 200, retry.text
    cred = retry.json()["credential"]
    hb = httpx.post(
        f"{c.url}/api/v1/agent/heartbeat",
        json={"node_id": "retry-node"},
        headers={"Authorization": f"Bearer {cred}"},
        timeout=30,
    )
    assert hb.status_code == 200, hb.text
    c.manage(
        "from inventory.operations import cordon\nfrom django.utils import timezone\n"
        "cordon('retry-node', now=timezone.now())\n"
    )


def test_cordon_then_uncordon_of_a_silent_node_is_refused(cluster):
    c = cluster
    node = c.fleet.nodes[0]
    os.killpg(node.proc.pid, signal.SIGSTOP)
    try:
        _wait(lambda: c.nodes()[node.node_id][0] == "unreachable", timeout=30, what=c.summary)
        out = c.manage(
            "from inventory import operations\nfrom inventory.nodes import TransitionError\n"
            "from django.utils import timezone\n"
            f"operations.cordon({node.node_id!r}, now=timezone.now())\n"
            "try:\n"
            f"    operations.uncordon({node.node_id!r}, now=timezone.now())\n"
            "    print('uncordoned')\n"
            "except TransitionError as e:\n"
            "    print('refused:', e)\n"
        )
        assert out.startswith(f"refused: node {node.node_id}: its agent has been silent since"), out
        assert c.nodes()[node.node_id][0] == "cordoned"
    finally:
        os.killpg(node.proc.pid, signal.SIGCONT)
