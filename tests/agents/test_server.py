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
            for _ in range(200):
                assert proc.poll() is None, "the server exited"
                try:
                    http.get("/heartbeat")
                    break
                except httpx.TransportError:
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
