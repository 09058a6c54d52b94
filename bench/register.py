"""CPU of one registration: the join storm's unit of work, this tree against another revision.

Each run is a process of its own over the project's WSGI application (as the
web server calls it, the agent endpoints' fast path included, DEBUG off),
registering BENCH_REGISTER_NODES new nodes with the bootstrap join token. The
bodies are the fleet simulator's (llmgw_sim/virtual_node.py over the shipped
hardware profiles, in turn), so a registration carries what an agent's own
discovery reads of a real machine. It reports the CPU (user + system) of the
process and of its PostgreSQL backend a registration, and the wall time.

With BENCH_REGISTER_AGAINST=<git revision> (for example `main`), that
revision's tree (git archive) is measured in the same way, the runs
alternating with this tree's, BENCH_REGISTER_RUNS (3) each: min/median/max
of both, the load average beside each run. The database is
<configured name>_bench_register, migrated by this tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
JOIN = "bench-register-join-token"
PROFILES = ("hgx-h100", "gb200-nvl", "roce", "cpu-only")


def _database_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{parts.path.lstrip('/') or 'llmgw'}_bench_register"))


def _env(db_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DATABASE_URL": db_url,
            "DATABASE_CONN_MAX_AGE": "600",
            "SECRET_KEY": "bench-register-secret-key-of-some-length",
            "DEBUG": "0",
            "LLMGW_JOIN_TOKEN": JOIN,
            "LOG_LEVEL": "WARNING",
            "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw") + "-bench-register",
        }
    )
    return env


def _measure(tree: Path, env: dict[str, str], nodes: int, prefix: str) -> dict:
    """One run in a process of its own, importing the project from `tree`."""
    env = {**env, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--measure", str(nodes), prefix],
        cwd=tree, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(nodes: int, prefix: str) -> None:
    """The measuring process: imports only the tree it runs in (never bench/)."""
    import io
    import types

    import django

    django.setup()
    from django.db import connection

    from inventory.models import Node
    from llmgw.wsgi import application
    from llmgw_sim.virtual_node import ProfileTemplate, VirtualNode

    templates = [ProfileTemplate.read(name) for name in PROFILES]
    fleet = types.SimpleNamespace(prefix=prefix, interval=5.0, labels={}, clock=time.time, shard_state=None)
    bodies = [VirtualNode(fleet, i, templates[i % len(templates)], "").registration() for i in range(nodes + 1)]

    def register(body: bytes) -> None:
        status = []
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": "/api/v1/agent/register", "SCRIPT_NAME": "",
            "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000", "HTTP_HOST": "127.0.0.1:8000",
            "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr,
            "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)),
            "HTTP_AUTHORIZATION": f"Bearer {JOIN}",
        }  # fmt: skip
        answer = b"".join(application(environ, lambda s, h: status.append(s)))
        if not status[0].startswith("200") or b'"credential":"llmgw-node-' not in answer:
            raise SystemExit(f"registration refused: {status[0]} {answer[:300]!r}")

    Node.objects.filter(id__startswith=f"{prefix}-").delete()
    register(bodies[0])  # warm: the connection, the prepared statements' first uses, imports
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        backend = cur.fetchone()[0]
    pg0, cpu0, wall0 = _proc_cpu(backend), time.process_time(), time.perf_counter()
    for body in bodies[1:]:
        register(body)
    cpu, wall, pg = time.process_time() - cpu0, time.perf_counter() - wall0, _proc_cpu(backend) - pg0
    Node.objects.filter(id__startswith=f"{prefix}-").delete()
    ms = 1000 / nodes
    print(json.dumps({"cpu_ms": cpu * ms, "pg_ms": pg * ms, "wall_ms": wall * ms}))


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process on this machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _export(revision: str, into: Path) -> Path:
    """The tree of a git revision, as files under `into`."""
    archive = into / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", revision], cwd=ROOT, stdout=f, check=True)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _summary(label: str, runs: list[dict]) -> list[str]:
    def mmm(key: str) -> str:
        values = sorted(r[key] for r in runs)
        return f"{values[0]:.2f} / {statistics.median(values):.2f} / {values[-1]:.2f} ms"

    return [
        f"{label}: CPU a registration, web process {mmm('cpu_ms')}, PostgreSQL {mmm('pg_ms')} (min / median / max); "
        f"wall {mmm('wall_ms')}; load average per run: {', '.join(r['load'] for r in runs)}"
    ]


def run() -> list[str]:
    from bench.heartbeat import _recreate_database

    nodes = int(os.environ.get("BENCH_REGISTER_NODES", 400))
    runs = int(os.environ.get("BENCH_REGISTER_RUNS", 3))
    against = os.environ.get("BENCH_REGISTER_AGAINST", "")
    db_url = _database_url()
    env = _env(db_url)
    _recreate_database(db_url)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    results: dict[str, list[dict]] = {"this tree": []}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-register-") as tmp:
        trees = {"this tree": ROOT}
        if against:
            trees = {f"{against}": _export(against, Path(tmp)), **trees}
            results = {against: [], "this tree": []}
        for k in range(runs):
            for label, tree in trees.items():
                load = _loadavg()
                r = _measure(tree, env, nodes, f"bench-reg-{k}")
                r["load"] = load
                results[label].append(r)
    lines = [f"{nodes} new nodes a run (the simulator's bodies: {', '.join(PROFILES)} in turn), join token"]
    for label, rs in results.items():
        lines += _summary(label, rs)
    return lines


if __name__ == "__main__" and sys.argv[1:2] == ["--measure"]:
    # Run as a file: its own folder (bench/) first on the path is no place to import from.
    del sys.path[0]
    _child(int(sys.argv[2]), sys.argv[3])
