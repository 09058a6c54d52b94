"""One client connection of the native server (gateway/dataplane/server.py): parsed, run and answered in order."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools

from gateway.dataplane.exchange import HIGH_WATER, REASONS, STATUS_LINES, Exchange

if TYPE_CHECKING:
    from gateway.dataplane.server import Server

log = logging.getLogger("gateway.server")

# The most a request's head (its line and headers) may take.
HEAD_LIMIT = 64 * 1024
# Seconds a connection closed with its request's body unread still has its input read and dropped:
# closed at once, the unread bytes would reset it, and the client could lose the answer it was sent.
LINGER_S = 1.0
METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")}
ASGI = {"version": "3.0", "spec_version": "2.3"}


class Connection(asyncio.Protocol):
    """One client's connection: its requests parsed as they arrive, run one at a time, answered in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.lost = False
        self.current: Exchange | None = None
        self.parsing: Exchange | None = None
        self.pending: deque[Exchange] = deque()
        self.reading_paused = False
        self.writing_paused = False
        self.drained: asyncio.Future | None = None
        self.gone_waiters: list[asyncio.Future] = []
        # Called as the connection is lost, before any task runs again: the data plane's relay stops
        # its client's stream this way without a task of its own waiting on `receive`.
        self.lost_hooks: list[Callable[[], None]] = []
        # Called once the client has caught up with what was written (a relay paused for it).
        self.drain_hooks: list[Callable[[], None]] = []
        # The request's way past ASGI's messages (gateway.dataplane.http.Native).
        self.extensions = {"llmgw.native": self}
        self.closing = False
        # Lingering: what still arrives is dropped unread.
        self.dropping = False
        # When the request being parsed began (monotonic), until its head is complete; the bytes read
        # meanwhile, and its line's and headers' size.
        self.head_since = 0.0
        self.head_read = 0
        self.head_size = 0
        self.idle_since = time.monotonic()
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    # The loop's callbacks.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A client has connected."""
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """The client has gone: every wait on it ends."""
        self.lost = True
        self.server.connections.discard(self)
        for exchange in (self.current, self.parsing, *self.pending):
            if exchange is not None:
                exchange._wake()
        for hook in list(self.lost_hooks):
            hook()
        self._drained()
        for fut in self.gone_waiters:
            if not fut.done():
                fut.set_result(None)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        """Bytes from the client, parsed as they come."""
        if self.dropping:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol but HTTP/1.1 here: the request is answered, then the connection closed.
            self.closing = True
            self.pause()
            return
        except httptools.HttpParserError:
            self.refuse(400)
            return
        if self.head_since:
            # A head still incomplete after this read: counted after parsing, so its first read counts too.
            self.head_read += len(data)
            if self.head_read > HEAD_LIMIT:
                self.refuse(431)

    def pause_writing(self) -> None:
        """The client is behind reading: streams wait for it."""
        self.writing_paused = True

    def resume_writing(self) -> None:
        """The client has caught up."""
        self.writing_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self._drained()

    def _drained(self) -> None:
        hooks, self.drain_hooks = self.drain_hooks, []
        for hook in hooks:
            hook()

    # The parser's callbacks.

    def on_message_begin(self) -> None:
        """A request begins."""
        self.url = b""
        self.headers = []
        self.parsing = None
        self.head_since = time.monotonic()
        self.head_read = 0
        self.head_size = 0

    def on_url(self, url: bytes) -> None:
        """A part of the request's target."""
        self.url += url
        self.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header (its name lower-cased, as ASGI has it)."""
        self.headers.append((name.lower(), value))
        self.head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        """The head is in: the request runs now, or after those before it."""
        self.head_since = 0.0
        if self.head_size > HEAD_LIMIT:
            self.refuse(431)
            return
        parser = self.parser
        method = parser.get_method()
        url = self.url
        if url[:1] != b"/":
            parsed = httptools.parse_url(url)
            raw, query = parsed.path or b"/", parsed.query or b""
        else:
            raw, _, query = url.partition(b"?")
        path = raw.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        scope = {
            "type": "http",
            "asgi": ASGI,
            "http_version": parser.get_http_version(),
            "server": self.server.address,
            "client": self.client,
            "scheme": "http",
            "method": METHODS.get(method) or method.decode("latin-1"),
            "root_path": "",
            "path": path,
            "raw_path": raw,
            "query_string": query,
            "headers": self.headers,
            "extensions": self.extensions,
        }
        if (b"expect", b"100-continue") in self.headers and not self.current:
            # A client that waits to be asked for its body (curl's larger POSTs) would wait a second.
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        exchange = Exchange(self, scope, parser.should_keep_alive() and not self.server.stopping)
        self.parsing = exchange
        if self.current is None:
            self.start(exchange)
        else:
            # Pipelined: answered once the ones before it are. Nothing more is read meanwhile.
            self.pending.append(exchange)
            self.pause()

    def on_body(self, body: bytes) -> None:
        """A part of the request's body."""
        if self.parsing is not None and not self.parsing.finished:
            self.parsing.feed(body)

    def on_message_complete(self) -> None:
        """The request's body is complete."""
        if self.parsing is not None:
            self.parsing.end()

    # Running requests.

    def start(self, exchange: Exchange) -> None:
        """Run the application on `exchange`."""
        self.current = exchange
        self.loop.create_task(self.run(exchange))

    async def run(self, exchange: Exchange) -> None:
        """The application on `exchange`, and what its end leaves to do.

        Its end is handled here, in its own task, rather than by a done callback: a callback is
        one more turn of the loop for every request.
        """
        tasks = self.server.tasks
        task = asyncio.current_task()
        tasks.add(task)
        try:
            await self.server.app(exchange.scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("the application failed on %s %s", exchange.scope["method"], exchange.scope["path"])
        finally:
            tasks.discard(task)
        if exchange.finished or self.lost:
            return
        if not exchange.started:
            # It answered nothing (a client that left first, or a failure): a plain 500, and the connection closed.
            exchange.keep_alive = False
            exchange.status, exchange.headers = 500, [(b"content-type", b"text/plain; charset=utf-8")]
            self.transport.write(exchange.head(b"Internal Server Error", False))
            exchange.finished = True
            self.answered(exchange)
        else:
            # An answer broken off midway: the client must see it end short, not wait for more.
            self.close()

    def answered(self, exchange: Exchange) -> None:
        """`exchange`'s answer is written: the next request's turn, or the connection's end."""
        if self.server.access_log:
            s = exchange.scope
            log.info('%s - "%s %s HTTP/%s" %d', self.client[0] if self.client else "-", s["method"], s["path"],
                     s["http_version"], exchange.status)  # fmt: skip
        self.current = None
        if not exchange.keep_alive or self.closing or self.server.stopping:
            if exchange.complete:
                self.close()
            else:
                self.linger()
            return
        if not exchange.complete:
            # The rest of the body it did not read still comes, and is dropped as it does.
            exchange.keep_alive = False
            self.linger()
            return
        if self.pending:
            self.start(self.pending.popleft())
            self.resume()
        else:
            self.idle_since = time.monotonic()

    def pause(self) -> None:
        """Stop reading the connection (the application is behind)."""
        if not self.reading_paused and not self.lost:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the connection again, unless requests still wait their turn or a body is buffered."""
        if self.reading_paused and not self.pending and not self.closing and not self.lost:
            if self.parsing is not None and self.parsing.buffered > HIGH_WATER:
                return
            self.reading_paused = False
            self.transport.resume_reading()

    def write_body(self, data: bytes) -> bool:
        """A part of the running request's answer, written at once (gateway.dataplane.http.Native)."""
        return False if self.current is None else self.current.write(data)

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the client has caught up, or at once if it is not behind."""
        if self.writing_paused and not self.lost:
            self.drain_hooks.append(callback)
        else:
            callback()

    async def drain(self) -> None:
        """Wait until the client has read what was written (or gone)."""
        if self.writing_paused and not self.lost:
            self.drained = self.loop.create_future()
            await self.drained

    async def gone(self) -> None:
        """Wait until the client has closed the connection."""
        if self.lost:
            return
        fut = self.loop.create_future()
        self.gone_waiters.append(fut)
        try:
            await fut
        finally:
            self.gone_waiters.remove(fut)

    def refuse(self, status: int) -> None:
        """Answer a request that cannot be taken (malformed, its head too large or too slow) and close."""
        if self.current is None and not self.lost:
            body = b"%d %s" % (status, REASONS[status])
            self.transport.write(
                STATUS_LINES[status] + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: %d\r\n%b\r\n%b" % (len(body), self.server.date, body)
            )
        self.linger()

    def close(self) -> None:
        """Close the connection."""
        if not self.lost and not self.transport.is_closing():
            self.transport.close()

    def linger(self) -> None:
        """Stop writing, drop what still arrives for LINGER_S, then close."""
        self.closing = True
        if self.lost:
            return
        self.dropping = True
        self.pending.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.close)
