"""The data plane's connections to replicas: HTTP/1.1 on the loop's own protocol (link.py), kept alive per replica.

A request takes the connection its replica used last (LIFO) in constant time;
one the engine has closed is seen from the event loop (its end of stream
arrived) without a system call. httpx's pool, used before, looked at every
pooled connection on each request and on each answer's end (a poll and a
getpeername each, and a count of the idle ones for each idle one): with 64
clients streaming that was most of the gateway's time per request.

Only what the data plane needs: POST with a body, answers framed by
Content-Length, chunks or the connection's end, read as they arrive.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from gateway.dataplane.link import Link

READ_SIZE = 65536
# The most an answer's status line and headers may take.
HEAD_LIMIT = 64 * 1024


class UpstreamError(Exception):
    """The connection to a replica failed: refused, timed out, reset or closed mid-answer, or spoke no HTTP."""


class _Conn:
    __slots__ = ("idle_since", "link")

    def __init__(self, link: Link) -> None:
        self.link, self.idle_since = link, 0.0

    def usable(self, now: float, expiry: float) -> bool:
        return not self.link.eof and not self.link.is_closing() and now - self.idle_since < expiry


class Deadline:
    """The reads of one answer: a read that has waited `timeout` seconds raises TimeoutError in its task.

    One timer for the whole answer, moved on only when it fires: asyncio.timeout
    around each read set a timer and cancelled it on every read, three or four a
    request, a tenth of the data plane's own time on a stream.
    """

    __slots__ = ("expired", "handle", "loop", "since", "task", "timeout")

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        # When the read now waiting began (the loop's clock); 0.0 while none waits.
        self.since = 0.0
        self.task: asyncio.Task | None = None
        self.expired = False
        self.handle = self.loop.call_at(self.loop.time() + timeout, self._fire)

    def _fire(self) -> None:
        now = self.loop.time()
        if self.since and now - self.since >= self.timeout and self.task is not None:
            self.expired = True
            self.task.cancel()
            return
        self.handle = self.loop.call_at((self.since or now) + self.timeout, self._fire)

    async def read(self, pending: Awaitable[bytes]) -> bytes:
        """`pending`'s bytes; TimeoutError when they have not come within the timeout."""
        self.since = self.loop.time()
        self.task = asyncio.current_task()
        try:
            return await pending
        except asyncio.CancelledError:
            if self.expired and self.task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self.since = 0.0

    def close(self) -> None:
        """No more reads: the timer goes."""
        self.handle.cancel()


class Framing:
    """An answer's body framing undone as its bytes arrive: chunks, a length, or the connection's end.

    Fed each read; gives back the body's bytes in it. Every complete chunk in
    what has arrived comes out at once (one write to the client, not one per
    chunk), walked by offset and cut once a read: cutting after each chunk
    copied the rest every time.
    """

    __slots__ = ("buf", "chunked", "done", "left", "to_close")

    def __init__(self, headers: dict[str, str]) -> None:
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.to_close = not self.chunked and "content-length" not in headers
        self.left = 0 if self.chunked or self.to_close else int(headers["content-length"])
        self.done = not self.chunked and not self.to_close and self.left <= 0
        self.buf = b""

    def feed(self, data: bytes) -> bytes:
        """The body's bytes in `data`; ValueError for chunks that are not HTTP's."""
        if self.done:
            return b""
        if self.to_close:
            return data
        if not self.chunked:
            data = data[: self.left]
            self.left -= len(data)
            self.done = self.left <= 0
            return data
        buf = self.buf + data if self.buf else data
        out = []
        pos = 0
        while (i := buf.find(b"\r\n", pos)) >= 0:
            size = int(buf[pos:i].split(b";", 1)[0], 16)
            if size == 0:
                if buf.find(b"\r\n\r\n", i) < 0:
                    break
                self.done = True
                self.buf = b""
                return b"".join(out)
            end = i + 2 + size
            if len(buf) < end + 2:
                break
            out.append(buf[i + 2 : end])
            pos = end + 2
        self.buf = buf[pos:] if pos else buf
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def end(self) -> None:
        """The connection has ended: the body with it, or UpstreamError if it was not complete."""
        if self.to_close:
            self.done = True
        if not self.done:
            raise UpstreamError("the replica closed the connection mid-answer")


class Response:
    """A replica's answer: its status and headers (lower-case names), the body read as it arrives."""

    def __init__(
        self, pool: Pool, origin: tuple, conn: _Conn, status: int, headers: dict[str, str], keep: bool,
        deadline: Deadline,
    ) -> None:  # fmt: skip
        self.status_code = status
        self.headers = headers
        self._pool, self._origin, self._conn = pool, origin, conn
        self._framing = Framing(headers)
        # Read to its close, the connection cannot carry another answer.
        self._keep = keep and not self._framing.to_close
        self._done = self._framing.done
        self._deadline = deadline

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed); UpstreamError if it breaks off."""
        framing, link = self._framing, self._conn.link
        try:
            while not framing.done:
                data = await self._deadline.read(link.read(READ_SIZE))
                if not data:
                    framing.end()
                    break
                if body := framing.feed(data):
                    yield body
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from e
        self._done = True

    async def relay(self, deliver: Callable[[bytes], None]) -> None:
        """Hand the body's bytes to `deliver` from the loop's read callback as they arrive; return at its end.

        No task wakes for a read: `deliver` runs in the callback, and must not
        block. UpstreamError if the body breaks off, or (its cause a
        TimeoutError) when no byte has come for the read timeout. `pause`
        and `resume` hold the replica while the client is behind.
        """
        framing, link, deadline = self._framing, self._conn.link, self._deadline
        loop = deadline.loop
        ended = loop.create_future()

        def sink(data: bytes) -> None:
            try:
                if not data:
                    framing.end()
                else:
                    # The timeout counts from the last byte: a stream that keeps coming never times out.
                    deadline.since = loop.time()
                    if body := framing.feed(data):
                        deliver(body)
                if framing.done and not ended.done():
                    link.sink = None
                    ended.set_result(None)
            except BaseException as e:  # a malformed chunk, a break-off, or `deliver`'s own failure
                link.sink = None
                if not ended.done():
                    ended.set_exception(e)

        if first := link.take():
            sink(first)
        elif link.eof:
            sink(b"")
        if not ended.done():
            link.sink = sink
        try:
            await deadline.read(ended)
        except (OSError, ValueError) as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from e
        finally:
            link.sink = None
        self._done = True

    def pause(self) -> None:
        """Stop reading the replica (the client is behind)."""
        if self._conn is not None:
            self._conn.link.hold()

    def resume(self) -> None:
        """Read the replica again."""
        if self._conn is not None:
            self._conn.link.release()

    async def aclose(self) -> None:
        """Give the connection back if the answer was read to its end, else close it (the engine sees it)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._deadline.close()
        if self._done and self._keep:
            # An answer whose last part found the client behind: the next request's answer must be read.
            conn.link.release()
            self._pool._put(self._origin, conn)
        else:
            conn.link.close()


class Pool:
    """Kept-alive connections to each replica, taken last-in first-out."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        keepalive_expiry: float,
        max_idle: int,
        on_reopen: Callable[[], object] | None = None,
    ):
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.keepalive_expiry, self.max_idle = keepalive_expiry, max_idle
        self._idle: dict[tuple, list[_Conn]] = {}
        self._origins: dict[str, tuple] = {}
        self._ssl: ssl.SSLContext | None = None
        # Requests sent again on a new connection after a kept-alive one was found closed (post),
        # and whoever else counts them (the gateway's llmgw_gateway_upstream_reopened_total).
        self.reopened = 0
        self._on_reopen = on_reopen

    def _origin(self, url: str) -> tuple[tuple, str]:
        base, sep, path = url.partition("/v1/")
        origin = self._origins.get(base)
        if origin is None:
            parts = urlsplit(base)
            tls = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            prefix = parts.path.rstrip("/")
            origin = (host, parts.port or (443 if tls else 80), tls, parts.netloc.encode(), prefix)
            self._origins[base] = origin
        return origin, f"{origin[4]}{sep}{path}" if sep else origin[4] or "/"

    async def _connect(self, origin: tuple) -> _Conn:
        host, port, tls = origin[0], origin[1], origin[2]
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, link = await loop.create_connection(lambda: Link(loop), host, port, ssl=self._ssl if tls else None)
        return _Conn(link)

    def _take(self, origin: tuple) -> _Conn | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.keepalive_expiry):
                return conn
            conn.link.close()
        return None

    def _put(self, origin: tuple, conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self.max_idle:
            conn.link.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def post(self, url: str, body: bytes, headers: bytes) -> Response:
        """POST `body` to `url` with `headers` (complete "Name: value\\r\\n" lines); the answer once its head is in.

        A kept-alive connection that the engine closed as the request went out, before any byte of
        an answer, is given up and the request sent once more on a new connection: llama.cpp's
        server closes every connection after a streamed answer although its head promised
        keep-alive, and a request sent in the instant between the answer's end and the close
        arriving found it gone. Counted in `reopened`.
        """
        origin, path = self._origin(url)
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, path, body, headers)
            except UpstreamError as e:
                if not _closed_unanswered(e.__cause__):
                    raise
                self.reopened += 1
                if self._on_reopen is not None:
                    self._on_reopen()
        return await self._exchange(origin, None, path, body, headers)

    async def _exchange(self, origin: tuple, conn: _Conn | None, path: str, body: bytes, headers: bytes) -> Response:
        # One request on `conn` (a new connection when None), up to its answer's head.
        deadline: Deadline | None = None
        try:
            if conn is None:
                conn = await self._connect(origin)
            head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
                path.encode(),
                origin[3],
                len(body),
                headers,
            )
            link = conn.link
            link.write(head + body if len(body) < READ_SIZE else head)
            if len(body) >= READ_SIZE:
                link.write(body)
            await link.drain()
            deadline = Deadline(self.read_timeout)
            raw = await deadline.read(link.readuntil(b"\r\n\r\n", HEAD_LIMIT))
            status, fields, keep = _parse_head(raw)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            _abandon(conn, deadline)
            raise UpstreamError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
        except BaseException:
            _abandon(conn, deadline)
            raise
        return Response(self, origin, conn, status, fields, keep, deadline)

    async def aclose(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for conn in idle:
                conn.link.close()
        self._idle.clear()


def _closed_unanswered(exc: BaseException | None) -> bool:
    # The connection ended or was reset before any byte of an answer: not a timeout, not a
    # malformed or partial answer, which a new connection would not mend.
    if isinstance(exc, asyncio.IncompleteReadError):
        return not exc.partial
    return isinstance(exc, ConnectionResetError | BrokenPipeError)


def _abandon(conn: _Conn | None, deadline: Deadline | None) -> None:
    if conn is not None:
        conn.link.close()
    if deadline is not None:
        deadline.close()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str], bool]:
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1 answer: {lines[0][:80]!r}")
    status = int(rest[:3])
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
    return status, fields, keep
