"""llmgw/settings.py's connection pool: `make run`'s server holds at most DATABASE_POOL_MAX connections.

runserver starts a thread per request. With persistent connections each
thread kept its own, so the connections grew with the requests until
PostgreSQL refused everyone. The server here runs as `make run` runs it
(DEBUG=1, runserver) on the test database, answers many concurrent API
requests, and PostgreSQL is asked throughout how many connections it holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from llmgw import tokens
from tests.factories import make_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REPO = Path(__file__).resolve().parents[2]
APP = "llmgw-pool-test"
BOUND = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _url(name: str | None = None) -> str:
    s = connection.settings_dict
    auth = quote(s["USER"] or "", safe="") + (":" + quote(s["PASSWORD"], safe="") if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{name or s['NAME']}"


def _held(watch: psycopg.Connection) -> int:
    """The server's connections to the test database, by the application name it connects with."""
    row = watch.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
        [connection.settings_dict["NAME"], APP],
    ).fetchone()
    return row[0]


def test_concurrent_requests_never_hold_more_connections_than_the_pool(tmp_path, operator, now):
    for i in range(3):
        make_node(f"node-{i}", now=now)
    _, token = tokens.create(operator, "pool-test", now=timezone.now())
    port = _free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        "DEBUG": "1",
        "DATABASE_URL": _url(),
        # With DATABASE_POOL_MAX=0 (persistent connections, as before the pool) it held 57.
        "DATABASE_POOL_MAX": str(BOUND),
        "CELERY_BROKER_URL": "memory://",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        # libpq's own variable: every connection of the server says who it is.
        "PGAPPNAME": APP,
    }
    log = tmp_path / "runserver.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Token {token}"}
    peak = [0]
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/api/v1/nodes/", headers=headers, timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"runserver did not answer: {log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.1)

        with psycopg.connect(_url(), autocommit=True) as watch:

            def watcher() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _held(watch))
                    time.sleep(0.01)

            seen = threading.Thread(target=watcher)
            seen.start()

            def call(_: int) -> int:
                # A new client each time: a thread of the server per request, as many browsers and agents make.
                with httpx.Client(timeout=60) as c:
                    return c.get(f"{base}/api/v1/nodes/?limit=2", headers=headers).status_code

            try:
                with ThreadPoolExecutor(max_workers=24) as pool:
                    codes = list(pool.map(call, range(120)))
            finally:
                stop.set()
                seen.join()
            after = _held(watch)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    assert codes == [200] * 120
    # The requests overlapped (the pool was used to its bound) and never went past it.
    assert 1 <= peak[0] <= BOUND, f"peak {peak[0]} connections for a pool of {BOUND}"
    assert after <= BOUND
