"""Server processes that die are replaced, and none outlives its master: the web server and the gateway.

Each runs as `make run` starts it (scripts/serve.sh, scripts/gateway.sh:
granian, two workers; the gateway on its native server too). Under a steady stream of requests, a worker is
killed (SIGKILL): another takes its place and the requests go on, none
refused, the few that the dead worker held failing; then the master is
killed: another is started at once on the same socket (llmgw/listen.py),
its workers leave within seconds instead of serving on beside the new
ones, and no request fails.
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
        self.refused = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        # What fails must be what the dead worker held (a reset), not an answer slowed by a loaded machine
        # while the new worker starts: a wait long enough that only a request nobody answers times out.
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                try:
                    ok = http.get(self.url).status_code == 200
                except httpx.ConnectError as exc:
                    self.errors.add(repr(exc))
                    self.refused += 1
                    ok = False
                except httpx.HTTPError as exc:
                    self.errors.add(repr(exc))
                    ok = False
                if ok:
                    self.ok += 1
                else:
                    self.failed += 1
                # A client's pace, not a flood: what fails is counted in requests a client would have sent.
                time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def _kill_a_worker_then_the_master(pid: int, needle: str, url: str) -> None:
    workers = wait_until(lambda: len(procs.find(pid, needle, leaf=True)) == 2 and procs.find(pid, needle, leaf=True),
                         timeout=60, what="two workers")  # fmt: skip
    # The script execs the socket's holder (llmgw/listen.py); the master is the workers' parent.
    master = procs.parent(workers[0])
    assert master != pid and procs.parent(master) == pid
    stream = Stream(url)
    try:
        wait_until(lambda: stream.ok > 20, timeout=30, what="answers")
        os.kill(workers[0], signal.SIGKILL)
        wait_until(
            lambda: len(now := procs.find(pid, needle, leaf=True)) == 2 and workers[0] not in now,
            timeout=30, what="a worker in the dead one's place",
        )  # fmt: skip
        ok = stream.ok
        wait_until(lambda: stream.ok > ok + 100, timeout=30, what="answers after the respawn")
        # The socket is the holder's, not the worker's: nothing is refused while the worker is
        # replaced. What can fail is what the killed worker held, one request per client thread.
        assert stream.failed <= 2 and not stream.refused, (stream.failed, stream.errors)
        failed = stream.failed

        alive = procs.find(pid, needle, leaf=True)
        os.kill(master, signal.SIGKILL)
        new = wait_until(
            lambda: [m for m in procs.find(pid, needle) if procs.parent(m) == pid and m != master],
            timeout=30, what="a master in the dead one's place",
        )  # fmt: skip
        wait_until(lambda: len(procs.find(new[0], needle, leaf=True)) == 2, timeout=60, what="its two workers")
        wait_until(lambda: not any(Path(f"/proc/{w}").exists() and _running(w) for w in alive), timeout=20,
                   what="the orphaned workers leaving")  # fmt: skip
        ok = stream.ok
        wait_until(lambda: stream.ok > ok + 100, timeout=30, what="answers from the new master's workers")
        # Connections made meanwhile waited in the held socket's backlog; the orphaned workers
        # finished what they held as they left.
        assert stream.failed == failed and not stream.refused, (failed, stream.failed, stream.errors)
    finally:
        stream.close()


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


@pytest.mark.parametrize(("interface", "needle"), [("asgi", "gateway.asgi:app"), ("native", "gateway.native")])
def test_a_gateway_worker_that_dies_is_replaced_and_a_dead_masters_workers_leave(tmp_path, interface, needle):
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        "DEBUG": "0",
        "SECRET_KEY": "llmgw-process-deaths",
        "DATABASE_URL": database_url(),
        "LLMGW_GATEWAY_WORKERS": "2",
        "LLMGW_GATEWAY_INTERFACE": interface,
        "LLMGW_WEB_LOG_LEVEL": "warning",
        "PYTHON": sys.executable,
    }
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gateway.sh"), f"127.0.0.1:{port}"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        _kill_a_worker_then_the_master(proc.pid, needle, f"http://127.0.0.1:{port}/health")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
