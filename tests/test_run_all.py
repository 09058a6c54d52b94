"""scripts/run-all.sh (what `make run` ends in) says "llmgw is up" only when it is."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.cleanenv import REPO, Background, clean_env, free_port, wait_until

pytestmark = pytest.mark.slow


def run_all(tmp_path, listen: str) -> Background:
    env = clean_env(DEBUG="1", LLMGW_VAR_DIR=str(tmp_path / "var"), LLMGW_LISTEN=listen, LLMGW_START_TIMEOUT="120")
    # The gateway is the fourth process: a port of its own, since a gateway that cannot listen stops them all.
    env["LLMGW_GATEWAY_LISTEN"] = f"127.0.0.1:{free_port()}"
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
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


def test_a_web_server_that_dies_is_reported_and_never_called_up(tmp_path):
    # Another program holds the port: runserver exits at once, and run-all.sh must say so and stop.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_all(tmp_path, f"127.0.0.1:{port}")
        try:
            wait_until(lambda: not proc.alive(), timeout=180, what="run-all.sh stopping", context=proc.output)
        finally:
            proc.stop()
    out = proc.output()
    assert proc.proc.returncode == 1, out
    assert f"llmgw: the web server on 127.0.0.1:{port} exited before it answered" in out
    assert "llmgw is up" not in out
