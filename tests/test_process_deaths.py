"""Server processes that die are replaced, and none outlives its master: the web server and the gateway.

Each runs as `make run` starts it (scripts/serve.sh, scripts/gateway.sh:
granian, two workers). Under a steady stream of requests, a worker is
killed (SIGKILL): another takes its place and the requests go on, the few
that the dead worker held failing; then the master is killed: its workers
leave within seconds instead of serving on beside the master started in
its place.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench import procs
from tests.agents.test_slow_clients import Server
from tests.cleanenv import free_port, wait_until
from tests.gateway.conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[1]


class Stream:
    """GET `url` from two threads until stopped; counts answers and failures."""

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failed = url, 0, 0
        self.errors: set[str] = set()
        self.failed_at: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.is_set():
                try:
                    ok = http.get(self.url).status_code == 200
                except httpx.HTTPError as exc:
                    self.errors.add(repr(exc))
                    ok = False
                if ok:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.failed_at.append(time.monotonic())
                # A client's pace, not a flood: what fails is counted in requests a client would have sent.
                time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def _kill_a_worker_then_the_master(pid: int, needle: str, url: str) -> None:
    workers = wait_until(lambda: len(procs.find(pid, needle, leaf=True)) == 2 and procs.find(pid, needle, leaf=True),
                         timeout=60, what="two workers")  # fmt: skip
    stream = Stream(url)
    try:
        wait_until(lambda: stream.ok > 20, timeout=30, what="answers")
        os.kill(workers[0], signal.SIGKILL)
        wait_until(
            lambda: len(now := procs.find(pid, needle, leaf=True)) == 2 and workers[0] not in now,
            timeout=30, what="a worker in the dead one's place",
        )  # fmt: skip
        # Counted, not bounded: until its replacement listens (it loads Django first), the connections
        # the kernel hands the dead worker's socket are refused (granian's workers each listen with
        # SO_REUSEPORT). Then every request is answered again.
        wait_until(
            lambda: not stream.failed_at or time.monotonic() - stream.failed_at[-1] > 3,
            timeout=90,
            what="three seconds without a failure",
            context=lambda: str((stream.failed, stream.errors)),
        )
        failed = stream.failed
        ok = stream.ok
        wait_until(lambda: stream.ok > ok + 100, timeout=30, what="answers after the respawn")
        assert stream.failed == failed, (failed, stream.failed, stream.errors)
    finally:
        stream.close()
    alive = procs.find(pid, needle, leaf=True)
    # The script execs granian: its process is the master.
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(Path(f"/proc/{w}").exists() and _running(w) for w in alive), timeout=20,
               what="the orphaned workers leaving")  # fmt: skip


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_web_worker_that_dies_is_replaced_and_a_dead_masters_workers_leave(tmp_path):
    server = Server(tmp_path / "serve.log", WEB_CONCURRENCY="2")
    try:
        _kill_a_worker_then_the_master(server.proc.pid, "llmgw.web:app", f"{server.url}/admin/login/")
    finally:
        server.stop()


def test_a_gateway_worker_that_dies_is_replaced_and_a_dead_masters_workers_leave(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        "DEBUG": "0",
        "SECRET_KEY": "llmgw-process-deaths",
        "DATABASE_URL": database_url(),
        "LLMGW_GATEWAY_WORKERS": "2",
        "LLMGW_WEB_LOG_LEVEL": "warning",
        "PYTHON": sys.executable,
    }
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gateway.sh"), f"127.0.0.1:{port}"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        _kill_a_worker_then_the_master(proc.pid, "gateway.asgi:app", f"http://127.0.0.1:{port}/health")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
