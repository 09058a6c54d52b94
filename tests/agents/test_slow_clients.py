"""Slow and hostile clients cost the web server nothing: proved on the production server (scripts/serve.sh).

A hundred connections trickle a heartbeat's body a byte every half second,
as an attacker would: meanwhile the fleet's heartbeats and the admin's login
page are answered, and each trickled body is cut off with a 408 once
LLMGW_BODY_TIMEOUT has passed. And an agent request without a credential is
refused from its headers, its body never waited for, whatever the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection

from bench import procs
from bench.hostile import Trickle, request_head
from tests.agents.conftest import JOIN, heartbeat_payload
from tests.cleanenv import free_port, wait_until
from tests.factories import register_payload

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
BODY_TIMEOUT_S = 4


class Server:
    """scripts/serve.sh on a free port: one worker with two threads, the smallest there is."""

    def __init__(self, log: Path, **extra: str) -> None:
        db = connection.settings_dict
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "0",
            "SECRET_KEY": "llmgw-slow-clients",
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "LLMGW_JOIN_TOKEN": JOIN,
            "LLMGW_CACHE_PREFIX": settings.CACHES["default"].get("KEY_PREFIX", "llmgw-test"),
            "CELERY_BROKER_URL": "memory://",
            "WEB_CONCURRENCY": "1",
            "LLMGW_WEB_THREADS": "2",
            "LLMGW_BODY_TIMEOUT": str(BODY_TIMEOUT_S),
            "LLMGW_WEB_LOG_LEVEL": "warning",
            "PYTHON": sys.executable,
            **extra,
        }
        if "LLMGW_WEB_SERVER" not in extra:
            env.pop("LLMGW_WEB_SERVER", None)  # the default, whatever this environment says
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(ROOT / "scripts" / "serve.sh"), f"127.0.0.1:{self.port}"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def answers() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return httpx.get(f"{self.url}/admin/login/", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, timeout=60, what="the web server answering", context=lambda: self.log.read_text())

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path) -> Iterator[Server]:
    s = Server(tmp_path / "serve.log")
    yield s
    s.stop()


def _credential(url: str, node: str = "node-a") -> str:
    resp = httpx.post(
        f"{url}/api/v1/agent/register",
        json=register_payload(node),
        headers={"Authorization": f"Bearer {JOIN}"},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["credential"]


def test_a_hundred_trickled_bodies_stall_no_heartbeat_and_no_admin_page(server):
    # The default server is granian with the front (llmgw/web.py), not gunicorn.
    served = procs.descendants(server.proc.pid).values()
    assert any("llmgw.web:app" in cmd for cmd in served) and not any("gunicorn" in cmd for cmd in served), served
    auth = {"Authorization": f"Bearer {_credential(server.url)}"}
    # A token of the right shape, so that the front must read the body before Django may look the token up.
    forged = request_head("/api/v1/agent/heartbeat", headers={"Authorization": "Bearer llmgw-node-forged"})
    trickle = Trickle("127.0.0.1", server.port, forged, n=100).start()
    try:
        # Every connection is held by the server (none answered yet) while the fleet goes on.
        wait_until(lambda: trickle.open() == 100, timeout=5, what="100 trickling connections")
        with httpx.Client(base_url=server.url, timeout=3) as http:
            for i in range(10):
                resp = http.post("/api/v1/agent/heartbeat", json=heartbeat_payload(at=float(i)), headers=auth)
                assert resp.status_code == 200, resp.text
            assert http.get("/admin/login/").status_code == 200
        assert trickle.open() == 100, trickle.statuses()
        # Then each is cut off: a 408, and the connection closed, within seconds of the deadline.
        wait_until(lambda: trickle.open() == 0, timeout=BODY_TIMEOUT_S + 10, what="the trickles cut off",
                   context=lambda: str(trickle.statuses()))  # fmt: skip
        assert trickle.statuses() == {408: 100}
        assert trickle.held_s() < BODY_TIMEOUT_S + 5
    finally:
        trickle.stop()


@pytest.mark.parametrize(
    ("web_server", "tokens"),
    [
        # The front refuses a missing token from the headers; a wrong one is read within the deadline, then refused.
        ("granian", [None]),
        # A WSGI server streams the body to the view: the view refuses before reading it.
        ("gunicorn", [None, "llmgw-node-not-a-credential", "not-even-a-token"]),
    ],
)
def test_an_agent_request_without_a_credential_is_refused_before_its_body(tmp_path, web_server, tokens):
    server = Server(tmp_path / "serve.log", LLMGW_WEB_SERVER=web_server, LLMGW_BODY_TIMEOUT="60")
    try:
        for token in tokens:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(request_head("/api/v1/agent/heartbeat", headers=headers))
                started = time.monotonic()
                s.settimeout(5)
                answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 401"), answer
            assert time.monotonic() - started < 5
    finally:
        server.stop()


def test_gunicorn_cuts_a_trickled_body_off_within_the_deadline_while_other_requests_are_served(tmp_path):
    """Under gunicorn a trickled body holds a thread, but only until LLMGW_BODY_TIMEOUT (llmgw/deadline.py)."""
    deadline_s = 10  # long enough for the requests served meanwhile on a busy machine
    server = Server(
        tmp_path / "serve.log", LLMGW_WEB_SERVER="gunicorn", LLMGW_WEB_THREADS="3", LLMGW_BODY_TIMEOUT=str(deadline_s)
    )
    try:
        auth = {"Authorization": f"Bearer {_credential(server.url)}"}
        # Another node's body, its credential good (so the body is read), and an admin form's.
        other = {"Authorization": f"Bearer {_credential(server.url, 'node-b')}"}
        agent = Trickle(
            "127.0.0.1", server.port, request_head("/api/v1/agent/heartbeat", length=5000, headers=other), n=1
        )
        form = (
            b"POST /admin/login/ HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 5000\r\n"
            # A CSRF cookie, so that the view reads the form (for its token) rather than refusing at once.
            b"Cookie: csrftoken=" + b"a" * 32 + b"\r\n\r\nusername="
        )
        admin = Trickle("127.0.0.1", server.port, form, n=1)
        agent.start()
        admin.start()
        try:
            wait_until(lambda: agent.open() == 1 and admin.open() == 1, timeout=5, what="two trickling connections")
            # Two of the three threads held: the third serves the fleet and the admin meanwhile.
            with httpx.Client(base_url=server.url, timeout=10) as http:
                for i in range(2):
                    resp = http.post("/api/v1/agent/heartbeat", json=heartbeat_payload(at=float(i)), headers=auth)
                    assert resp.status_code == 200, resp.text
                assert http.get("/admin/login/").status_code == 200
            # ... while both trickles were still held.
            assert agent.open() == 1 and admin.open() == 1, (agent.statuses(), admin.statuses())
            wait_until(
                lambda: agent.open() == 0 and admin.open() == 0, timeout=deadline_s + 10,
                what="the trickles cut off", context=lambda: str((agent.statuses(), admin.statuses())),
            )  # fmt: skip
            assert agent.statuses() == {408: 1} and admin.statuses() == {408: 1}
            # Counted from when the application is handed the request (its headers parsed by then).
            assert max(agent.held_s(), admin.held_s()) < deadline_s + 5
            # The threads are free again: answered at once.
            with httpx.Client(base_url=server.url, timeout=3) as http:
                assert http.get("/admin/login/").status_code == 200
        finally:
            agent.stop()
            admin.stop()
    finally:
        server.stop()
