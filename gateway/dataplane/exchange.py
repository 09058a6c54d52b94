"""One request's ASGI cycle on the native server's connection: its body as it arrives, its answer framed and written."""

from __future__ import annotations

import asyncio
import http
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.dataplane.connection import Connection

# Body bytes buffered ahead of the application before the connection stops being read.
HIGH_WATER = 256 * 1024
REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, phrase) for code, phrase in REASONS.items()}
DISCONNECT = {"type": "http.disconnect"}


class Exchange:
    """One request: its scope, its body as it arrives, its answer written onto the connection."""

    __slots__ = ("body", "buffered", "chunked", "complete", "conn", "finished", "headers", "keep_alive",
                 "read_all", "scope", "started", "status", "waiter")  # fmt: skip

    def __init__(self, conn: Connection, scope: dict[str, Any], keep_alive: bool) -> None:
        self.conn, self.scope, self.keep_alive = conn, scope, keep_alive
        self.body: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.read_all = False
        self.waiter: asyncio.Future | None = None
        self.status: int | None = None
        self.headers: Any = ()
        self.started = False
        self.chunked = False
        self.finished = False

    def feed(self, data: bytes) -> None:
        """A part of the body has arrived."""
        self.body.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER:
            self.conn.pause()
        self._wake()

    def end(self) -> None:
        """The body is complete."""
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """The body as it has arrived, then http.disconnect once the client has gone."""
        conn = self.conn
        if self.read_all or self.finished:
            await conn.gone()
            return DISCONNECT
        if not self.body and not self.complete:
            if conn.lost:
                return DISCONNECT
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
            if not self.body and not self.complete:
                return DISCONNECT
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        conn.resume()
        if self.complete:
            self.read_all = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.request", "body": body, "more_body": True}

    async def send(self, message: dict[str, Any]) -> None:
        """The answer's start is kept until its first body part: a whole answer goes out in one write."""
        kind = message["type"]
        if kind == "http.response.start":
            if self.status is not None:
                raise RuntimeError("the answer has already started")
            self.status = message["status"]
            self.headers = message.get("headers", ())
            return
        if kind != "http.response.body" or self.finished:
            return
        if self.status is None:
            raise RuntimeError("an answer's body before its start")
        if self._write(message.get("body", b""), message.get("more_body", False)):
            await self.conn.drain()

    def write(self, body: bytes) -> bool:
        """A part of the answer's body written at once, outside any task (its start sent before); True: client behind.

        The relay's way of passing a stream through from the replica's read
        callback (pool.Response.relay): an await per part was a task step per token.
        """
        if self.status is None:
            raise RuntimeError("an answer's body before its start")
        return False if self.finished else self._write(body, True)

    def _write(self, body: bytes, more: bool) -> bool:
        # The bytes framed and written; True while the client is behind reading them.
        conn = self.conn
        if conn.lost:
            # The client has gone: what is left of the answer has no one to read it.
            if not more:
                self.finished = True
            return False
        if self.scope["method"] == "HEAD":
            body = b""
        if not self.started:
            out = self.head(body, more)
        elif self.chunked and body:
            out = b"%x\r\n%b\r\n" % (len(body), body)
        else:
            out = body
        if not more and self.chunked:
            out += b"0\r\n\r\n"
        if out:
            conn.transport.write(out)
        if not more:
            self.finished = True
            conn.answered(self)
            return False
        return conn.writing_paused

    def head(self, body: bytes, more: bool) -> bytes:
        """The answer's status line and headers, framed for what follows, with `body`'s first part."""
        self.started = True
        status = self.status
        parts = [STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        length = False
        for name, value in self.headers:
            if name == b"content-length":
                length = True
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            elif name == b"transfer-encoding":
                continue
            parts.append(b"%b: %b\r\n" % (name, value))
        parts.append(self.conn.server.date)
        if not length and status >= 200 and status not in (204, 304):
            if not more:
                parts.append(b"content-length: %d\r\n" % len(body))
            elif self.scope["http_version"] == "1.1":
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                # HTTP/1.0 has no chunks: the stream ends with the connection.
                self.keep_alive = False
        if not self.complete or self.conn.server.stopping:
            # Answered before its body has all come (the rest is dropped, and the connection with it),
            # or the server is stopping: the client is told the connection ends here.
            self.keep_alive = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        elif self.scope["http_version"] == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if self.chunked and body:
            parts.append(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            parts.append(body)
        return b"".join(parts)
