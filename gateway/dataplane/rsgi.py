"""An ASGI application served over granian's RSGI interface: `granian --interface rsgi gateway.rsgi:app`.

Under ASGI every answer's start and every body part is a message the server
takes from the event loop's thread to its own, awaited each. RSGI answers a
whole body with one call that is not awaited, and a stream with one awaited
write per part. The data plane and whatever is mounted in front of it (the
agents' long-poll and lease renewals) stay ASGI applications: each request
is handed to the same ASGI callable, its messages carried straight to RSGI's
calls, so every path answers as it does under ASGI.

The ASGI lifespan (gateway/dataplane/lifespan.py) runs in the worker's start
and stop hooks (`__rsgi_init__`, `__rsgi_del__`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.dataplane.http import Scope
from gateway.dataplane.lifespan import Lifespan


class Exchange:
    """One request's ASGI `receive` and `send`, carried onto an RSGI protocol object."""

    __slots__ = ("chunks", "headers", "known_length", "proto", "read", "status", "stream")

    def __init__(self, proto: Any, known_length: bool) -> None:
        self.proto = proto
        # A body whose length the client declared is read in one call; otherwise part by part.
        self.known_length = known_length
        self.read = False
        self.chunks: Any = None
        self.status = 200
        self.headers: list[tuple[str, str]] = []
        self.stream: Any = None

    async def receive(self) -> dict[str, Any]:
        """The body (whole when its length was declared), then http.disconnect once the client has gone."""
        if not self.read:
            if self.known_length:
                self.read = True
                return {"type": "http.request", "body": await self.proto(), "more_body": False}
            if self.chunks is None:
                self.chunks = aiter(self.proto)
            chunk = await anext(self.chunks, None)
            if chunk is not None:
                return {"type": "http.request", "body": chunk, "more_body": True}
            self.read = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.proto.client_disconnect()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        """An answer's start is kept until its body: a whole body goes out in one call, a streamed one part by part."""
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]
            return
        if kind != "http.response.body":
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream is None:
            if not more:
                self.proto.response_bytes(self.status, self.headers, body)
                # Marks the answer sent: anything after it is not sent again.
                self.stream = False
                return
            self.stream = self.proto.response_stream(self.status, self.headers)
        if body and self.stream is not False:
            await self.stream.send_bytes(body)


def asgi_scope(scope: Any) -> Scope:
    """RSGI's request scope as ASGI's (headers as lower-case bytes pairs, the client as (host, port))."""
    host, _, port = scope.client.rpartition(":")
    server_host, _, server_port = scope.server.rpartition(":")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": scope.http_version,
        "method": scope.method,
        "scheme": scope.scheme,
        "path": scope.path,
        "raw_path": scope.path.encode(),
        "query_string": scope.query_string.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()],
        "client": (host.strip("[]"), int(port or 0)),
        "server": (server_host.strip("[]"), int(server_port or 0)),
    }


class RSGIApp:
    """An ASGI application (with its lifespan) as granian's RSGI target."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lifespan = Lifespan(app)

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.proto != "http":
            return
        exchange = Exchange(proto, "content-length" in scope.headers)
        await self.app(asgi_scope(scope), exchange.receive, exchange.send)
        if exchange.stream is None:
            # The application answered nothing (a client that left first): close the request plainly.
            proto.response_empty(500, [])

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.lifespan.startup())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.lifespan.shutdown())
