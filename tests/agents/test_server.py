"""The production web server (scripts/serve.sh) serving the agent endpoints over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection

from inventory.models import Node
from tests.agents.conftest import JOIN, heartbeat_payload
from tests.factories import register_payload

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def _os_chosen_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("server", ["granian", "gunicorn"])
def test_serve_script_runs_the_agent_fast_path(server):
    db = connection.settings_dict
    port = _os_chosen_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        "DEBUG": "0",
        "SECRET_KEY": "llmgw-server-test",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "LLMGW_JOIN_TOKEN": JOIN,
        "LLMGW_CACHE_PREFIX": settings.CACHES["default"].get("KEY_PREFIX", "llmgw-test"),
        "CELERY_BROKER_URL": "memory://",
        "LLMGW_WEB_SERVER": server,
        "WEB_CONCURRENCY": "1",
        "LLMGW_WEB_THREADS": "2",
        "LLMGW_WEB_LOG_LEVEL": "warning",
        "PYTHON": sys.executable,
    }
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh"), f"127.0.0.1:{port}"], cwd=ROOT, env=env)
    try:
        base = f"http://127.0.0.1:{port}/api/v1/agent"
        with httpx.Client(base_url=base, timeout=10) as http:
            # Until it answers, not for a count of tries: on busy cores granian took over 10 s to start.
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "the server exited"
                try:
                    http.get("/heartbeat")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the server did not answer within 60 s"
                    time.sleep(0.05)
            resp = http.post("/register", json=register_payload("node-a"), headers={"Authorization": f"Bearer {JOIN}"})
            assert resp.status_code == 200, resp.text
            # No middleware on the agent path: no session cookie, no clickjacking header.
            assert "set-cookie" not in resp.headers and "x-frame-options" not in resp.headers
            auth = {"Authorization": f"Bearer {resp.json()['credential']}"}
            resp = http.post("/heartbeat", json=heartbeat_payload(at=1.0, counters=10), headers=auth)
            assert resp.status_code == 200, resp.text
            assert resp.json()["commands"] == []
            assert http.post("/heartbeat", json=heartbeat_payload("node-b"), headers=auth).status_code == 403
            # The rest of the site still goes through the middleware stack.
            assert http.get(f"http://127.0.0.1:{port}/admin/login/").headers["x-frame-options"] == "DENY"
        assert Node.objects.get(id="node-a").last_seen is not None
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, "0 600"), ({"DATABASE_POOL_MAX": "4"}, "4 600"), ({"DATABASE_CONN_MAX_AGE": "60"}, "0 60")],
)
def test_serve_script_keeps_one_persistent_connection_per_thread_unless_told(tmp_path, given, expected):
    # The server's fixed threads bound persistent connections; the pool's checkout check would cost
    # every request a round trip to PostgreSQL. What the server process is started with, not run.
    python = tmp_path / "python"
    # The script asks scripts/port_free.py first (tests/test_run_all.py covers that); then the server.
    python.write_text(
        '#!/bin/sh\ncase "$1" in */port_free.py) exit 0;; esac\necho "$DATABASE_POOL_MAX $DATABASE_CONN_MAX_AGE"\n'
    )
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_POOL_MAX", "DATABASE_CONN_MAX_AGE")}
    env.update(given, PYTHON=str(python))
    for server in ("granian", "gunicorn"):
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "serve.sh"), "127.0.0.1:1"],
            cwd=ROOT, env={**env, "LLMGW_WEB_SERVER": server}, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert (done.returncode, done.stdout.strip()) == (0, expected), done.stderr
