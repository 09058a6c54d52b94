"""The socket's holder (llmgw/listen.py): one bind, the server its child, a killed server started again on it.

The servers themselves (granian's master and workers killed under load, no
request refused) are tests/test_process_deaths.py; here the holder's own
rules, with a small Python server as its child.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from llmgw import listen, orphans
from tests.cleanenv import free_port, wait_until

# A child that serves "pid\n" to each connection on the inherited socket, until killed.
CHILD = (
    "import os, socket\n"
    "s = socket.socket(fileno=int(os.environ['LLMGW_LISTEN_FD']))\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(f'{os.getpid()}\\n'.encode())\n"
    "    c.close()\n"
)


def _ask(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        return int(c.makefile().readline())


def test_the_inherited_socket_is_ours_or_systemds_first():
    assert listen.inherited_fd({"LLMGW_LISTEN_FD": "7"}) == 7
    assert listen.inherited_fd({"LISTEN_FDS": "1", "LISTEN_PID": "42"}, pid=42) == 3
    # Passed to another process (the variables inherited by a child): not ours.
    assert listen.inherited_fd({"LISTEN_FDS": "1", "LISTEN_PID": "41"}, pid=42) is None
    assert listen.inherited_fd({}) is None
    with pytest.raises(ValueError, match="LISTEN_FDS is 2"):
        listen.inherited_fd({"LISTEN_FDS": "2", "LISTEN_PID": "42"}, pid=42)


@pytest.mark.parametrize("sockets", [1, 2])
def test_a_port_held_by_another_program_is_refused_naming_it(sockets):
    # A group of the holder's own sockets (one for each worker) refuses it too, rather than joining it.
    port = free_port()
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", port))
    other.listen()
    try:
        with pytest.raises(OSError, match=re.escape(f"127.0.0.1:{port} cannot be listened on")):
            listen.bind_group(f"127.0.0.1:{port}", sockets)
    finally:
        other.close()
    with pytest.raises(OSError, match=r"nohost\.invalid:x is not an address"):
        listen.bind("nohost.invalid:x")


def test_a_killed_server_is_started_again_on_the_same_socket_and_nothing_is_refused(tmp_path):
    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-m", "llmgw.listen", "hold", f"127.0.0.1:{port}", "--", sys.executable, "-c", CHILD],
        cwd=Path(__file__).resolve().parents[2],
        stderr=open(tmp_path / "err", "wb"),  # noqa: SIM115 - the child keeps it
    )
    try:
        first = wait_until(lambda: _try(port), timeout=30, what="the first server")
        os.kill(first, signal.SIGKILL)
        # Asked once the killed child is gone (a child still dying could take the connection and close it
        # with no answer), before the new one runs: the connection waits in the backlog, it is not refused.
        wait_until(lambda: _gone(first), timeout=30, what="the killed server gone")
        second = _ask(port)
        assert second != first and holder.poll() is None
        assert "was killed (SIGKILL); starting it again" in (tmp_path / "err").read_text()
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(10) == 0
    finally:
        holder.kill()
        holder.wait(10)


def _gone(pid: int) -> bool:
    """Whether a process has died (gone, or a zombie not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _try(port: int) -> int | None:
    try:
        return _ask(port)
    except OSError:
        return None


def test_a_server_that_exits_by_itself_ends_the_hold_with_its_status(tmp_path):
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.listen", "hold", f"127.0.0.1:{port}", "--", sys.executable, "-c",
         "import sys; sys.exit(3)"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 3
    assert f"the server on 127.0.0.1:{port} exited (status 3)" in done.stderr


def test_an_orphan_waits_for_a_successor_of_its_holder_and_not_for_itself(tmp_path):
    # This process stands for the holder; a child shell for a new master; its child for a ready worker.
    me = os.getpid()
    assert not orphans.successor_ready(tmp_path, holder=me, dead=12345)
    master = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    try:
        worker = wait_until(lambda: _child_of(master.pid), timeout=10, what="the worker")
        # An orphan's own mark (or a mark of the dead master's workers) is no successor.
        (tmp_path / str(worker)).touch()
        assert not orphans.successor_ready(tmp_path, holder=me, dead=master.pid)
        assert orphans.successor_ready(tmp_path, holder=me, dead=12345)
    finally:
        master.kill()
        master.wait(10)
    # The holder gone: no successor will come, the orphan leaves.
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert orphans.successor_ready(tmp_path, holder=gone.pid, dead=12345)


def _child_of(pid: int) -> int | None:
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _granian_hold(
    port: int, tmp_path: Path, *, sockets: int, workers: int, app: str = "tests.llmgw.pid_app:app"
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw.listen", "hold", f"127.0.0.1:{port}", "--sockets", str(sockets), "--",
         sys.executable, "-m", "llmgw.listen", "serve", "--interface", "asgi", "--workers", str(workers),
         "--log-level", "warning", app],
        cwd=Path(__file__).resolve().parents[2],
        stdout=open(tmp_path / "out", "wb"),  # granian's log
        stderr=open(tmp_path / "err", "wb"),
        start_new_session=True,
    )  # fmt: skip


def _pids_of_connections(port: int, count: int) -> Counter:
    """How many of `count` connections opened together each worker answered (kept alive, each asked twice)."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(count)]
    for c in conns:
        c.connect()
    served: Counter = Counter()
    try:
        for c in conns:
            c.request("GET", "/")
            first = c.getresponse().read().decode()
            c.request("GET", "/")
            # A kept-alive connection stays with the worker that accepted it.
            assert c.getresponse().read().decode() == first
            served[first] += 1
    finally:
        for c in conns:
            c.close()
    return served


def _listening_inodes(port: int) -> set[str]:
    """The inodes of the sockets listening on `port` (/proc/net/tcp: local address, state 0A = LISTEN)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
                found.add(fields[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                out.add(target[8:-1])
    return out


def test_each_worker_accepts_on_a_socket_of_its_own_and_connections_are_spread_over_them(tmp_path):
    # On one socket every worker accepted on, connections opened together piled onto one worker (74 % of a
    # core against 1 % at 5,000 simulated nodes): a process's threads share one interpreter lock.
    port = free_port()
    holder = _granian_hold(port, tmp_path, sockets=2, workers=2)
    try:
        wait_until(lambda: _try_get(port), timeout=60, what="the workers")
        served = _pids_of_connections(port, 64)
        # Two workers, both serving a share: the kernel hashes each new connection to one of the sockets
        # (fewer than 16 of 64 on one is a chance of about one in 30,000).
        assert len(served) == 2, served
        assert min(served.values()) >= 16, served
        # Two sockets listening on the port, both the holder's (a worker that dies leaves its own there).
        listening = _listening_inodes(port)
        assert len(listening) == 2
        assert listening <= _socket_inodes(holder.pid)
    finally:
        os.killpg(holder.pid, signal.SIGTERM)
        holder.wait(20)


def test_a_worker_that_does_not_stop_is_killed_after_the_grace_and_the_hold_ends(tmp_path):
    # granian's master waited for such a worker for good (one signalled as it started, with the whole
    # process group), and the service's stop with it.
    port = free_port()
    holder = _granian_hold(port, tmp_path, sockets=1, workers=1, app="tests.llmgw.stubborn_app:app")
    try:
        wait_until(lambda: _try_get(port), timeout=60, what="the worker")
        asked = time.monotonic()
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(orphans.GRACE_S + 30) == 0
        assert time.monotonic() - asked >= orphans.GRACE_S - 0.5
        assert "Killing worker-1 after it refused to gracefully stop" in (tmp_path / "out").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)


def test_serve_bounds_a_workers_stop_unless_told_otherwise():
    base = ["--interface", "asgi", "app:app"]
    assert listen.granian_args(base, {}) == [*base, "--workers-kill-timeout", "10"]
    assert listen.granian_args([*base, "--workers-kill-timeout", "30"], {}) == [*base, "--workers-kill-timeout", "30"]
    assert listen.granian_args([*base, "--workers-kill-timeout=30"], {}) == [*base, "--workers-kill-timeout=30"]
    assert listen.granian_args(base, {"GRANIAN_WORKERS_KILL_TIMEOUT": "30"}) == base


def test_more_sockets_than_workers_is_refused_naming_both(tmp_path):
    # A socket of the group that no worker accepts on would hold its share of connections unanswered.
    holder = _granian_hold(free_port(), tmp_path, sockets=3, workers=2)
    assert holder.wait(60) != 0
    assert (
        "3 listening sockets held for 2 worker(s): hold with --sockets equal to --workers"
        in (tmp_path / "err").read_text()
    )


def test_a_group_of_sockets_shares_one_port():
    port = free_port()
    held = listen.bind_group(f"127.0.0.1:{port}", 3)
    try:
        assert len({s.getsockname() for s in held}) == 1 and len(held) == 3
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in held)
    finally:
        for s in held:
            s.close()


def _try_get(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


def test_a_server_of_one_socket_refuses_a_holder_of_several():
    # The gateway's own server and gunicorn accept on LLMGW_LISTEN_FD alone: the other sockets' share of
    # the connections would wait for good.
    assert listen.only_socket({"LLMGW_LISTEN_FD": "5"}) == 5
    assert listen.only_socket({"LLMGW_LISTEN_FD": "5", "LLMGW_LISTEN_FDS": "5"}) == 5
    with pytest.raises(SystemExit, match=r"its holder keeps 2 \(LLMGW_LISTEN_FDS\): run .* without --sockets"):
        listen.only_socket({"LLMGW_LISTEN_FD": "5", "LLMGW_LISTEN_FDS": "5,6"})
