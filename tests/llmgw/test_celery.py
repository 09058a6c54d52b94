"""llmgw/celery.py: beat starts and sends its periodic tasks on the README's Redis broker.

Beat runs as a real process, in an interpreter that can import only what
requirements.txt brings (with its dependencies' own requirements): every
other installed distribution, the test tools included, is hidden from it.
With the Redis broker, kombu's transport imports `packaging`, which only the
test tools brought in once, and beat died of it on a fresh install.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Runs in the child: hides the modules of distributions requirements.txt does not bring, then runs celery.
_CHILD = """
import importlib.abc, json, os, sys
hidden = frozenset(json.loads(os.environ.pop("LLMGW_TEST_HIDDEN_MODULES")))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r} (not in requirements.txt)", name=name)
        return None
sys.meta_path.insert(0, Hide())
from celery.__main__ import main
sys.argv = ["celery", *sys.argv[1:]]
main()
"""


def run_requirements_closure(path: Path) -> set[str]:
    """The distributions a file of requirements installs: its own lines and, transitively, what each requires."""
    todo = [
        Requirement(line.split("#")[0].strip()) for line in path.read_text().splitlines() if line.split("#")[0].strip()
    ]
    extras: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        wanted = {"", *req.extras}
        if name in extras and wanted <= extras[name]:
            continue
        extras[name] = extras.get(name, set()) | wanted
        try:
            specs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for spec in specs:
            dep = Requirement(spec)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras[name]):
                todo.append(dep)
    return set(extras)


def hidden_modules(closure: set[str]) -> list[str]:
    """Top-level modules of installed distributions outside the closure (never the standard library's)."""
    return sorted(
        top
        for top, dists in md.packages_distributions().items()
        if top not in sys.stdlib_module_names and not any(canonicalize_name(d) in closure for d in dists)
    )


def test_the_run_requirements_closure_follows_extras_and_leaves_test_tools_out():
    closure = run_requirements_closure(REPO / "requirements.txt")
    assert {"django", "celery", "kombu", "redis", "packaging", "sortedcontainers", "psycopg-binary"} <= closure
    assert {"pytest", "hypothesis", "ruff", "playwright"}.isdisjoint(closure)
    hidden = hidden_modules(closure)
    assert {"pytest", "hypothesis", "playwright"} <= set(hidden)
    assert {"packaging", "kombu", "django"}.isdisjoint(hidden)


def test_beat_sends_its_tasks_on_a_redis_broker_with_only_the_run_requirements(tmp_path):
    broker_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12")
    queue = redis.Redis.from_url(broker_url)
    queue.delete("celery")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings_test",
        "CELERY_BROKER_URL": broker_url,
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        # The embedded database: beat takes its cluster lock there (llmgw/beat.py), so it must reach one.
        "DATABASE_URL": f"sqlite:///{tmp_path / 'var' / 'llmgw.sqlite3'}",
        # The liveness sweep is due soon after beat starts.
        "LLMGW_LIVENESS_INTERVAL": "0.5",
        "LLMGW_TEST_HIDDEN_MODULES": json.dumps(hidden_modules(run_requirements_closure(REPO / "requirements.txt"))),
        "PYTHONPATH": str(REPO),
    }
    # As scripts/run-all.sh prepares it: beat keeps its schedule there.
    (tmp_path / "var" / "celery").mkdir(parents=True)
    log = tmp_path / "beat.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, "-A", "llmgw", "beat", "--loglevel=INFO"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        sent = []
        while time.monotonic() < deadline and proc.poll() is None:
            sent = [json.loads(m)["headers"]["task"] for m in queue.lrange("celery", 0, -1)]
            if sent:
                break
            time.sleep(0.1)
        text = log.read_text(errors="replace")
        assert proc.poll() is None, f"beat exited with {proc.returncode}: {text[-3000:]}"
        assert "agents.liveness_sweep" in sent, f"beat sent {sent} in 60 s: {text[-3000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
        queue.delete("celery")
