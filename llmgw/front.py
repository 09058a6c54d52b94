"""The web server's front: a request reaches a thread only with its whole body.

A WSGI server hands a request to one of its few threads once the headers
have come, and the application's read of the body then blocks that thread
until the client has sent it. A client trickling its body a byte every few
seconds held a thread as long as it liked: ten of them stopped the admin and
the fleet's heartbeats. So the control plane's web server runs this ASGI
application (`granian --interface asgi llmgw.web:app`, scripts/serve.sh):
each body is read on the event loop, where a waiting connection costs a
coroutine, within LLMGW_BODY_TIMEOUT seconds (then 408 and the connection is
closed) and up to MAX_BODY bytes (413, on the declared length before a byte is
read); only then does the request go, as WSGI with the body in memory, to
the same application the WSGI servers run (llmgw/wsgi.py) in a pool of
LLMGW_WEB_THREADS threads. It is what a buffering reverse proxy does
(docs/security.md), done by the server itself.

A request may ask to wait for the others: an RFC 9218 `Priority` header
with an urgency above the default (u=3) puts it in the background lane, and
a free thread takes every waiting request of the default lane first. Agents
send their routine status so (the 60-s floor, with nothing changed: see
llmgw_agent/status.py), so that a status reporting a shard ready, a
registration or an operator's page is not queued behind a fleet's minute of
routine refreshes; their leases meanwhile keep the node alive
(llmgw_agent/keepalive.py).

Each worker also leaves when its server's master is gone (llmgw/orphans.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings

from llmgw import orphans
from llmgw_wire.priority import DEFAULT_URGENCY, Lanes, urgency

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
WSGIApp = Callable[[dict, Callable], Iterable[bytes]]

# At least the largest body any endpoint takes (an agent's fabric scan, agents/api.py);
# each endpoint refuses more than its own bound after this (Django's
# DATA_UPLOAD_MAX_MEMORY_SIZE for forms).
MAX_BODY = 17 * 1024 * 1024
# The WSGI environ's key for when the front had the whole request (Unix seconds), before it waited for a thread.
RECEIVED_AT = "llmgw.received_at"


def _problem(detail: str) -> bytes:
    # The agent endpoints' error shape ({"detail", "errors"}); DRF's clients read `detail` too.
    return json.dumps({"detail": detail, "errors": []}).encode()


def environ_of(scope: Scope, body: bytes) -> dict[str, Any]:
    """The WSGI environ (PEP 3333) of an ASGI request whose whole body is `body`."""
    server = scope.get("server") or ("localhost", 80)
    client = scope.get("client") or ("", 0)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        # WSGI's strings are bytes read as latin-1; Django decodes them back as UTF-8.
        "SCRIPT_NAME": scope.get("root_path", "").encode("utf-8").decode("latin-1"),
        "PATH_INFO": scope["path"].encode("utf-8").decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "REMOTE_ADDR": str(client[0]),
        "REMOTE_PORT": str(client[1]),
        "CONTENT_LENGTH": str(len(body)) if body else "",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name == "content-length":
            continue  # the body's own length, above: a chunked body has none declared
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
            continue
        if "_" in name:
            # X-Forwarded_For would read as X-Forwarded-For: dropped, as Django's own server does.
            continue
        key = "HTTP_" + name.upper().replace("-", "_")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


class Front:
    """The ASGI application: whole bodies on the event loop, then the WSGI application in a thread."""

    def __init__(
        self,
        application: WSGIApp,
        *,
        threads: int,
        body_timeout: float,
        max_body: int = MAX_BODY,
        bearer_paths: tuple[str, ...] = (),
        bearer_refusal: tuple[str, str] = ("missing or invalid credentials", 'Bearer realm="llmgw"'),
    ) -> None:
        self.application = application
        self.threads = threads
        self.body_timeout = body_timeout
        self.max_body = max_body
        # Paths only a bearer token opens: a request to one without the header is refused
        # (401, `bearer_refusal`'s detail and WWW-Authenticate) before a byte of its body is read.
        self.bearer_paths = bearer_paths
        self.bearer_refusal = bearer_refusal
        self.pool: ThreadPoolExecutor | None = None
        # The pool's threads, handed out on the event loop (llmgw_wire/priority.py): taken before a request is
        # submitted and given back once its answer has started, so the pool itself never queues one (a
        # streamed answer's later chunks excepted) and a routine request waits behind every other.
        self.lanes: Lanes[None] = Lanes([None] * threads)

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="web")
        return self.pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        declared = None
        bearer = background = False
        for k, v in scope.get("headers", ()):
            k = k.lower()
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    await self._refuse(send, 400, "invalid Content-Length")
                    return
            elif k == b"authorization":
                bearer = v[:7].lower() == b"bearer " and bool(v[7:].strip())
            elif k == b"priority":
                background = urgency(v) > DEFAULT_URGENCY
        if not bearer and scope["path"].startswith(self.bearer_paths):
            detail, challenge = self.bearer_refusal
            await self._refuse(send, 401, detail, [(b"www-authenticate", challenge.encode("latin-1"))])
            return
        if declared is not None and declared > self.max_body:
            await self._refuse(send, 413, f"the body must be at most {self.max_body} bytes")
            return
        try:
            body = await self._read_body(receive)
        except TimeoutError:
            await self._refuse(send, 408, f"the body did not arrive within {self.body_timeout:g} s")
            return
        except ConnectionError:
            return
        if body is None:
            await self._refuse(send, 413, f"the body must be at most {self.max_body} bytes")
            return
        environ = environ_of(scope, body)
        # When the request was whole: what it says of its sender's clock is read against this, not
        # against the moment a thread took it (llmgw_agent's status may wait its turn, see Lanes).
        environ[RECEIVED_AT] = time.time()
        await self._serve(environ, send, background=background)

    async def _read_body(self, receive: Receive) -> bytes | None:
        # None past max_body; TimeoutError past the deadline; ConnectionError when the client left.
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectionError("the client left")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)

    async def _refuse(
        self, send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        body = _problem(detail)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # What is left of the body is never read: the connection cannot carry another request.
                    (b"connection", b"close"),
                    *(headers or ()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _serve(self, environ: dict, send: Send, *, background: bool = False) -> None:
        loop = asyncio.get_running_loop()
        pool = self._pool()
        await self.lanes.get(routine=background)
        started = pool.submit(self._start, environ)
        try:
            status, headers, chunks, rest = await asyncio.wrap_future(started)
        except asyncio.CancelledError:
            # The thread works on: it is given back when it is done, not before.
            started.add_done_callback(lambda _: loop.call_soon_threadsafe(self.lanes.put_nowait, None))
            raise
        except BaseException:
            self.lanes.put_nowait(None)
            raise
        self.lanes.put_nowait(None)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if rest is None:
            await send({"type": "http.response.body", "body": b"".join(chunks)})
            return
        # A streamed answer (a static file, an export): chunk by chunk, each read in the pool.
        try:
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            while True:
                chunk = await loop.run_in_executor(pool, next, rest, None)
                if chunk is None:
                    break
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            close = getattr(rest, "close", None)
            if close is not None:
                await loop.run_in_executor(pool, close)

    def _start(self, environ: dict) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], Iterator[bytes] | None]:
        # In a pool thread: the application's answer up to its first chunk (when it streams, the rest to iterate).
        started: list = []
        written: list[bytes] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info=None):
            if exc_info and started:
                raise exc_info[1].with_traceback(exc_info[2])
            started[:] = [status, headers]
            return written.append

        result = self.application(environ, start_response)
        if isinstance(result, list):
            chunks, rest = written + result, None
        else:
            it = iter(result)
            first = next(it, None)
            chunks = written + ([first] if first else [])
            rest = _Closing(it, result)
        status, headers = started
        encoded = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return int(status.split(" ", 1)[0]), encoded, chunks, rest

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                orphans.watch_parent()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.pool is not None:
                    self.pool.shutdown(wait=True)
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Closing:
    """An iterator over a WSGI answer that closes the answer (Django's request_finished) when asked."""

    def __init__(self, it: Iterator[bytes], result: Iterable[bytes]) -> None:
        self.it, self.result = it, result

    def __iter__(self) -> Iterator[bytes]:
        return self.it

    def __next__(self) -> bytes:
        return next(self.it)

    def close(self) -> None:
        close = getattr(self.result, "close", None)
        if close is not None:
            close()


def make_front(application: WSGIApp, **options: Any) -> Front:
    """The front for this process, sized by LLMGW_WEB_THREADS and LLMGW_BODY_TIMEOUT (`options`: Front's others)."""
    threads = int(os.environ.get("LLMGW_WEB_THREADS") or 4)
    return Front(application, threads=threads, body_timeout=settings.LLMGW_BODY_TIMEOUT, **options)
