"""Serving the agent endpoints without Django's middleware stack.

Every node heartbeats every few seconds, so the agent path is the control
plane's hottest by far. The middleware stack exists for people: sessions,
CSRF, authentication of users, messages, clickjacking headers, static files,
per-view request metrics. Agents authenticate with a bearer token and get
JSON, so /api/v1/agent/ is served by a handler with no middleware, which
roughly halves the framework's share of a heartbeat. It keeps Django's
request signals (database connections are reused and closed as usual), URL
resolution, exception handling (a crash is a logged 500) and the
ALLOWED_HOSTS check. The connection's health check asks the socket instead
of PostgreSQL (llmgw/db.py trust_idle_connection).

Everything else goes to the ordinary handler. `with_agent_fast_path` wraps
the project's WSGI application (llmgw/wsgi.py).

Either handler's answer, when it is not streamed, goes back to the server as
a list of one bytes object, closed first (request_finished: the database
connection is handed back before the bytes are written). Django's
HttpResponse is an iterator, and granian serves an iterator by calling into
it from its own side, chunk by chunk and then close(), each a trip for the
GIL: under a fleet's thousands of leases a second that took about a quarter
of the server's time holding the GIL. A list it writes in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.core.handlers.exception import convert_exception_to_response
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

from llmgw.db import trust_idle_connection

AGENT_PREFIX = "/api/v1/agent/"

WSGIApp = Callable[[dict, Callable], Iterable[bytes]]

# The only URLs the agent handler resolves: whatever else a path under the
# prefix might match in the project's URLconf, it cannot reach it here.
urlpatterns = [path(AGENT_PREFIX.lstrip("/"), include("agents.urls"))]


class AgentHandler(WSGIHandler):
    """A WSGI handler with an empty middleware stack, for the agent endpoints only."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._checked_response)

    def _checked_response(self, request: HttpRequest) -> HttpResponse:
        # CommonMiddleware would call this: a Host outside ALLOWED_HOSTS is a 400.
        request.get_host()
        request.urlconf = __name__
        # Every heartbeat would otherwise pay Django's `SELECT 1` health check (llmgw/db.py).
        trust_idle_connection()
        response = self._get_response(request)
        # As CommonMiddleware would: a known length spares the server chunked encoding.
        if not response.streaming and not response.has_header("Content-Length"):
            response.headers["Content-Length"] = str(len(response.content))
        return response


def as_bytes(response: Iterable[bytes]) -> Iterable[bytes]:
    """A response that is not streamed as `[its body]`, closed; a streamed one (files, iterators) as it is."""
    if not isinstance(response, HttpResponse):
        return response
    try:
        return [response.content]
    finally:
        response.close()


def with_agent_fast_path(application: WSGIApp, *, prefix: str = AGENT_PREFIX) -> WSGIApp:
    """A WSGI application sending requests under `prefix` to an AgentHandler, the rest to `application`."""
    agent = AgentHandler()

    def dispatch(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "").startswith(prefix):
            return as_bytes(agent(environ, start_response))
        return as_bytes(application(environ, start_response))

    dispatch.agent_handler = agent
    return dispatch
