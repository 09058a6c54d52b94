"""Liveness and readiness of a web process: GET /healthz and GET /readyz.

An orchestrator asks these every few seconds (Kubernetes' probes, compose's
health checks, a load balancer), so they are answered before Django's
request handling: no middleware, no session, no URL resolution, and no
ALLOWED_HOSTS check, since a kubelet's probe names the pod's address as its
Host, which no operator lists. Their bodies say only which dependency
failed, never an address or an error's text.

- /healthz: the process answers. A failing database is no reason to restart
  a web server (the restart cannot fix it), so liveness asks nothing else.
- /readyz: the process can serve: PostgreSQL answers a query. A process
  that cannot is taken out of its load balancer's rotation until it can.
  Redis is not asked: without it heartbeats still renew their leases in the
  database (momentary telemetry is skipped), so a Redis outage taking every
  web server out of rotation would stop the fleet's heartbeats for nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from django.db import close_old_connections, connection

log = logging.getLogger(__name__)

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"

WSGIApp = Callable[[dict, Callable], Iterable[bytes]]


def readiness_failures() -> list[str]:
    """The dependencies this process cannot reach now (["database"]); empty when it can serve."""
    failed: list[str] = []
    # As a request would: a connection past its age or broken is replaced, not reused.
    close_old_connections()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception:
        log.warning("readiness: the database does not answer", exc_info=True)
        failed.append("database")
    finally:
        close_old_connections()
    return failed


def _answer(start_response: Callable, status: str, body: dict) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def with_health(application: WSGIApp) -> WSGIApp:
    """A WSGI application answering GET /healthz and /readyz itself and passing the rest to `application`."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in (LIVENESS_PATH, READINESS_PATH):
            return application(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", {"status": "method not allowed"})
        if path == LIVENESS_PATH:
            return _answer(start_response, "200 OK", {"status": "ok"})
        failed = readiness_failures()
        if failed:
            return _answer(start_response, "503 Service Unavailable", {"status": "unavailable", "failed": failed})
        return _answer(start_response, "200 OK", {"status": "ok"})

    # What it wraps, by the convention functools.wraps follows: tests and tools look through it.
    app.__wrapped__ = application  # type: ignore[attr-defined]
    return app
