"""Liveness and readiness: the web process's /healthz and /readyz (llmgw/health.py), the gateway's.

The web's are asked of the project's real WSGI application (llmgw.wsgi) with
a Host no operator lists, as a kubelet's probe sends; readiness is shown
failing against a PostgreSQL that does not answer (a closed port), and not
failing for a Redis that does not. The gateway's are in tests/gateway/test_readiness.py.
"""

from __future__ import annotations

import io
import json
import socket

import pytest
import redis
from django.core.cache import cache
from django.db import connection

from llmgw import health
from llmgw.wsgi import application


def wsgi_get(path: str, *, method: str = "GET") -> tuple[str, dict]:
    """Call llmgw.wsgi.application as a server would; (status line, JSON body)."""
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SERVER_NAME": "10.1.2.3",
        "SERVER_PORT": "8000",
        "HTTP_HOST": "10.1.2.3:8000",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }
    status: list[str] = []
    body = b"".join(application(environ, lambda s, headers: status.append(s)))
    return status[0], json.loads(body)


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.django_db(transaction=True)
def test_liveness_and_readiness_answer_whatever_the_host():
    assert wsgi_get("/healthz") == ("200 OK", {"status": "ok"})
    assert wsgi_get("/readyz") == ("200 OK", {"status": "ok"})
    assert wsgi_get("/readyz", method="POST")[0] == "405 Method Not Allowed"
    # Anything else still goes through Django, which checks the Host.
    status = []
    application(
        {"REQUEST_METHOD": "GET", "PATH_INFO": "/admin/login/", "SERVER_NAME": "10.1.2.3", "SERVER_PORT": "8000",
         "HTTP_HOST": "10.1.2.3:8000", "wsgi.input": io.BytesIO(b""), "wsgi.url_scheme": "http",
         "wsgi.errors": io.StringIO()},
        lambda s, headers: status.append(s),
    )  # fmt: skip
    assert status == ["400 Bad Request"]


@pytest.mark.django_db(transaction=True)
def test_readiness_names_the_database_when_it_does_not_answer(settings):
    # The process's pool (DATABASE_POOL_MAX) holds connections to the real server: let it go, so
    # that the next connection is opened to an address where nothing answers.
    connection.close()
    connection.close_pool()
    saved = dict(connection.settings_dict)
    connection.settings_dict.update(HOST="127.0.0.1", PORT=str(closed_port()))
    options = dict(connection.settings_dict.get("OPTIONS") or {})
    options.pop("pool", None)
    connection.settings_dict["OPTIONS"] = {**options, "connect_timeout": 2}
    try:
        assert health.readiness_failures() == ["database"]
        assert wsgi_get("/readyz") == ("503 Service Unavailable", {"status": "unavailable", "failed": ["database"]})
        # Liveness does not depend on the database.
        assert wsgi_get("/healthz") == ("200 OK", {"status": "ok"})
    finally:
        connection.close()
        connection.close_pool()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
    assert health.readiness_failures() == []


@pytest.mark.django_db(transaction=True)
def test_a_redis_outage_leaves_the_web_ready(settings):
    # Heartbeats renew leases in PostgreSQL without Redis: taking every web server out of
    # rotation for a cache outage would stop them for nothing.
    settings.CACHES = {
        "default": {
            "BACKEND": "llmgw.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{closed_port()}/0",
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        }
    }
    with pytest.raises(redis.ConnectionError):
        cache.get("anything")
    assert health.readiness_failures() == []
    assert wsgi_get("/readyz") == ("200 OK", {"status": "ok"})
