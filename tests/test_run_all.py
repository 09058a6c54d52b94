"""scripts/run-all.sh (what `make run` ends in) says "llmgw is up" only when it is, with the new admin
password right after it, logs requests only when LLMGW_ACCESS_LOG asks, and starts again a child that
dies once all four are up."""

from __future__ import annotations

import os
import signal
import socket
import uuid

import httpx
import pytest

from bench import procs
from tests.cleanenv import REPO, Background, clean_env, free_port, wait_until

pytestmark = pytest.mark.slow


def run_all(tmp_path, listen: str, **extra: str) -> Background:
    env = clean_env(DEBUG="1", LLMGW_VAR_DIR=str(tmp_path / "var"), LLMGW_LISTEN=listen, LLMGW_START_TIMEOUT="120")
    # The gateway is the fourth process: a port of its own, since a gateway that cannot listen stops them all.
    env["LLMGW_GATEWAY_LISTEN"] = f"127.0.0.1:{free_port()}"
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LLMGW_ACCESS_LOG"):
        env.pop(name, None)
    env.update(extra)
    return Background(["scripts/run-all.sh"], cwd=REPO, env=env, log=tmp_path / "run-all.log")


def test_up_is_said_once_the_web_server_answers(tmp_path):
    port = free_port()
    proc = run_all(tmp_path, f"127.0.0.1:{port}")
    try:
        wait_until(lambda: "llmgw is up" in proc.output() or not proc.alive(), timeout=180, what="llmgw is up",
                   context=proc.output)  # fmt: skip
        assert proc.alive(), proc.output()
        # The moment it says so, it answers: no retry.
        assert httpx.get(f"http://127.0.0.1:{port}/admin/login/", timeout=10).status_code == 200
    finally:
        proc.stop()


@pytest.mark.parametrize("which", ["web", "gateway"])
def test_a_port_already_held_is_refused_before_anything_starts(tmp_path, which):
    # Another program holds the port: run-all.sh must say which and stop, never "up" (granian would share
    # the port with SO_REUSEPORT, and the probe could be answered by the other program).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        addr = f"127.0.0.1:{port}"
        extra = {"LLMGW_GATEWAY_LISTEN": addr} if which == "gateway" else {}
        proc = run_all(tmp_path, addr if which == "web" else f"127.0.0.1:{free_port()}", **extra)
        try:
            wait_until(lambda: not proc.alive(), timeout=60, what="run-all.sh stopping", context=proc.output)
        finally:
            proc.stop()
    out = proc.output()
    assert proc.proc.returncode == 1, out
    assert f"llmgw: port {port} on 127.0.0.1 is already in use" in out
    assert "llmgw is up" not in out
    # Refused before any server started: no worker, no beat, no web server said anything.
    assert "celery" not in out.lower() and "granian" not in out.lower()


def test_a_second_gateway_on_the_gateways_port_is_refused(tmp_path):
    port = free_port()
    env = clean_env(LLMGW_VAR_DIR=str(tmp_path / "var"))
    for name in ("DATABASE_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
    first = Background(["scripts/gateway.sh", f"127.0.0.1:{port}"], cwd=REPO, env=env, log=tmp_path / "first.log")
    try:
        wait_until(lambda: listeners(port) == 1 or not first.alive(), timeout=120, what="the first gateway",
                   context=first.output)  # fmt: skip
        assert first.alive(), first.output()
        second = Background(["scripts/gateway.sh", f"127.0.0.1:{port}"], cwd=REPO, env=env, log=tmp_path / "2.log")
        try:
            wait_until(lambda: not second.alive(), timeout=60, what="the second gateway", context=second.output)
        finally:
            second.stop()
        assert second.proc.returncode == 1, second.output()
        assert f"llmgw: port {port} on 127.0.0.1 is already in use" in second.output()
        # One listener on the port: the first gateway's, serving alone.
        assert listeners(port) == 1 and first.alive()
    finally:
        first.stop()


def listeners(port: int) -> int:
    """How many sockets listen on a TCP port of this machine (SO_REUSEPORT lets several)."""
    hexport = f":{port:04X}"
    count = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[1].endswith(hexport) and fields[3] == "0A"
    return count


@pytest.mark.parametrize("access_log", ["", "1"])
def test_requests_are_logged_only_with_the_access_log_and_a_new_password_comes_last(tmp_path, access_log):
    # What `manage.py ensure_admin --show-later` leaves when it has just created the login.
    var = tmp_path / "var"
    var.mkdir()
    (var / "admin-password").write_text("admin\nS3cret-pw\n")
    (var / "admin-password.show").touch()
    port, gateway = free_port(), f"127.0.0.1:{free_port()}"
    proc = run_all(tmp_path, f"127.0.0.1:{port}", LLMGW_ACCESS_LOG=access_log, LLMGW_GATEWAY_LISTEN=gateway)
    page = f"/admin/login/?next=/{uuid.uuid4().hex}/"
    poll = '"GET /api/v1/agent/wait HTTP/1.1" 401'
    try:
        wait_until(lambda: "llmgw is up" in proc.output() or not proc.alive(), timeout=180, what="llmgw is up",
                   context=proc.output)  # fmt: skip
        assert proc.alive(), proc.output()
        assert proc.output().split("llmgw is up", 1)[1].splitlines()[1:3] == [
            "admin login created: user 'admin', password 'S3cret-pw'",
            f"(kept in {var}/admin-password, readable by you alone)",
        ]
        assert not (var / "admin-password.show").exists()
        # A page of the web server, and an agent's long-poll at the gateway (refused: no credential).
        assert httpx.get(f"http://127.0.0.1:{port}{page}", timeout=10).status_code == 200
        assert httpx.get(f"http://{gateway}/api/v1/agent/wait?node=gpu-a", timeout=10).status_code == 401
        if access_log:
            wait_until(lambda: page in proc.output() and poll in proc.output(), timeout=30,
                       what="both requests' access lines", context=proc.output)  # fmt: skip
    finally:
        proc.stop()
    out = proc.output()
    logged = [line for line in out.splitlines() if page in line or "/api/v1/agent/wait" in line]
    if access_log:
        assert len(logged) == 2, out
        assert f'"GET {page} HTTP/1.1" 200' in logged[0] + logged[1]
    else:
        # Stopped, every process has written all it would: neither request left a line.
        assert logged == [], out


def test_a_child_that_dies_once_up_is_started_again_and_the_rest_keep_running(tmp_path):
    port, gateway = free_port(), f"127.0.0.1:{free_port()}"
    proc = run_all(tmp_path, f"127.0.0.1:{port}", LLMGW_GATEWAY_LISTEN=gateway)
    try:
        wait_until(lambda: "llmgw is up" in proc.output() or not proc.alive(), timeout=180, what="llmgw is up",
                   context=proc.output)  # fmt: skip
        assert proc.alive(), proc.output()
        for name, needle, answers in [
            ("web server", "runserver", lambda: httpx.get(f"http://127.0.0.1:{port}/admin/login/", timeout=5)),
            ("gateway", procs.gateway_needle(), lambda: httpx.get(f"http://{gateway}/health", timeout=5)),
            ("Celery worker", "worker --loglevel", None),
        ]:
            before = procs.find(proc.proc.pid, needle)
            assert before, procs.descendants(proc.proc.pid)
            for pid in before:
                os.kill(pid, signal.SIGKILL)
            said = f"llmgw: the {name} exited (status 137); starting it again"
            wait_until(lambda: said in proc.output(), timeout=30, what=said, context=proc.output)  # noqa: B023
            wait_until(
                lambda: (now := procs.find(proc.proc.pid, needle)) and not set(now) & set(before),  # noqa: B023
                timeout=60, what=f"a new {name}", context=proc.output,
            )  # fmt: skip
            if answers is not None:
                wait_until(lambda: _answers(answers), timeout=120, what=f"the {name} answering", context=proc.output)  # noqa: B023
            assert proc.alive(), proc.output()
    finally:
        proc.stop()


def _answers(get) -> bool:
    try:
        return get().status_code == 200
    except httpx.HTTPError:
        return False
