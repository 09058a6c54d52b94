"""The agent endpoints served without the middleware stack, and everything else with it."""

from __future__ import annotations

import contextlib
import io
import json
from contextlib import contextmanager

import pytest
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from agents.wsgi import AGENT_PREFIX, AgentHandler, with_agent_fast_path
from inventory.models import Node
from tests.agents.conftest import JOIN, heartbeat_payload
from tests.factories import register_payload

pytestmark = pytest.mark.django_db


@contextmanager
def _inside_test_transaction():
    # As Django's test client does: the request signals would close the
    # connection that holds the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def call(
    app,
    path: str,
    body=None,
    *,
    token: str | None = None,
    method: str = "POST",
    host: str = "127.0.0.1",
    signals: bool = False,
):
    """One WSGI request; returns (status code, headers, body bytes).

    signals=True keeps Django's connection handling at the request's start
    and end (only outside the test's transaction).
    """
    data = json.dumps(body).encode() if body is not None else b""
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": host,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(data)),
        "wsgi.input": io.BytesIO(data),
        "wsgi.errors": io.StringIO(),
        "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0),
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if token:
        environ["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    started = []
    with contextlib.nullcontext() if signals else _inside_test_transaction():
        result = app(environ, lambda status, headers, exc_info=None: started.append((status, headers)))
        try:
            payload = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
    status, headers = started[0]
    return int(status.split()[0]), dict(headers), payload


class Recorder:
    """A stand-in for the project's WSGI application: records what reached it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, environ, start_response):
        self.paths.append(environ["PATH_INFO"])
        start_response("204 No Content", [])
        return [b""]


@pytest.fixture
def app(join_token):
    other = Recorder()
    return with_agent_fast_path(other), other


def test_register_and_heartbeat_without_middleware(app):
    fast, other = app
    status, headers, body = call(fast, f"{AGENT_PREFIX}register", register_payload("node-a"), token=JOIN)
    assert status == 200, body
    credential = json.loads(body)["credential"]
    # No middleware ran: no session cookie, no clickjacking or content-type-options header.
    assert "Set-Cookie" not in headers
    assert "X-Frame-Options" not in headers
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Length"] == str(len(body))
    status, _, body = call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload(at=1.0), token=credential)
    assert status == 200, body
    assert json.loads(body)["commands"] == []
    assert Node.objects.get(id="node-a").last_seen is not None
    assert other.paths == []


def test_refusals_are_the_same_on_the_fast_path(app, joined):
    fast, _ = app
    status, headers, body = call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload())
    assert (status, json.loads(body)["detail"]) == (401, "missing or invalid credentials")
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, _, body = call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload(gpus=[{"index": 99}]), token=joined)
    assert status == 400
    assert json.loads(body)["errors"][0]["field"] == "gpus.0.index"
    status, headers, _ = call(fast, f"{AGENT_PREFIX}heartbeat", method="GET", token=joined)
    assert (status, headers["Allow"]) == (405, "POST")


def test_other_paths_go_to_the_project_application(app):
    fast, other = app
    for path in ("/admin/", "/api/v1/nodes/", "/metrics", "/api/v1/agentx"):
        assert call(fast, path)[0] == 204
    assert other.paths == ["/admin/", "/api/v1/nodes/", "/metrics", "/api/v1/agentx"]


def test_the_fast_path_reaches_agent_views_only(app):
    fast, other = app
    # Dot segments are not collapsed: nothing outside agents.urls resolves here.
    for path in (f"{AGENT_PREFIX}../nodes/", f"{AGENT_PREFIX}../../admin/", f"{AGENT_PREFIX}nodes"):
        assert call(fast, path)[0] == 404
    assert other.paths == []


def test_a_host_outside_allowed_hosts_is_400(app):
    fast, _ = app
    status, _, _ = call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload(), host="evil.example")
    assert status == 400


def test_the_project_application_uses_the_fast_path():
    from llmgw import wsgi

    # The health probes are answered first (llmgw/health.py), then the body deadline (llmgw/deadline.py),
    # then the agent's fast path.
    assert isinstance(wsgi.application.__wrapped__.__wrapped__.agent_handler, AgentHandler)


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_after_the_database_ended_the_connection_is_answered(app, join_token):
    from tests.test_db import _backend_pid, _terminate

    fast, _ = app
    status, _, body = call(fast, f"{AGENT_PREFIX}register", register_payload("node-a"), token=JOIN, signals=True)
    assert status == 200, body
    credential = json.loads(body)["credential"]
    assert call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload(at=1.0), token=credential, signals=True)[0] == 200
    pid = _backend_pid()
    # As a PostgreSQL restart does to every kept-alive connection.
    _terminate(pid)
    status, _, body = call(fast, f"{AGENT_PREFIX}heartbeat", heartbeat_payload(at=2.0), token=credential, signals=True)
    assert status == 200, body
    assert _backend_pid() != pid


def test_an_answer_goes_back_as_one_bytes_object_already_closed(app, joined):
    # granian writes a list in one call; an iterator it walks from its own side, a GIL trip a chunk.
    fast, _ = app
    finished = []

    def on_finished(**kwargs) -> None:
        finished.append(True)

    request_finished.connect(on_finished)
    try:
        started = []
        data = json.dumps(heartbeat_payload(at=1.0)).encode()
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": f"{AGENT_PREFIX}heartbeat", "SCRIPT_NAME": "", "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1", "HTTP_HOST": "127.0.0.1",
            "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(data)), "wsgi.input": io.BytesIO(data),
            "wsgi.errors": io.StringIO(), "wsgi.url_scheme": "http", "HTTP_AUTHORIZATION": f"Bearer {joined}",
        }  # fmt: skip
        with _inside_test_transaction():
            result = fast(environ, lambda status, headers, exc_info=None: started.append((status, headers)))
        assert type(result) is list and len(result) == 1 and isinstance(result[0], bytes)
        assert started[0][0] == "200 OK"
        assert json.loads(result[0])["commands"] == []
        # Closed before the server writes it: the request's connection handling has run.
        assert finished == [True]
    finally:
        request_finished.disconnect(on_finished)


def test_other_answers_are_bytes_too_and_streams_stay_streams():
    from django.http import FileResponse, HttpResponse

    def django_page(environ, start_response):
        start_response("200 OK", [])
        return HttpResponse(b"page", content_type="text/plain")

    def django_file(environ, start_response):
        start_response("200 OK", [])
        return FileResponse(io.BytesIO(b"file"))

    assert with_agent_fast_path(django_page)(_bare("/"), lambda *a: None) == [b"page"]
    streamed = with_agent_fast_path(django_file)(_bare("/"), lambda *a: None)
    assert isinstance(streamed, FileResponse)
    assert b"".join(streamed) == b"file"
    streamed.close()


def _bare(path: str) -> dict:
    return {"REQUEST_METHOD": "GET", "PATH_INFO": path, "wsgi.input": io.BytesIO(b"")}
