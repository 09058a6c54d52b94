"""The fleet's HTTP/1.1 client on asyncio: a few keep-alive connections shared by thousands of virtual nodes.

httpx's AsyncClient cost the fleet about 2.5 ms of CPU a request, as much as
the control plane spent answering it; asyncio's streams (StreamReader,
readuntil, readexactly, a timeout context per request) were still most of
what the fleet spent per heartbeat of its own. A connection here is a
Protocol: each request is one write of a head made once per path and token
with only the length spliced in, the answer is parsed where it arrives and
hands its one future the result (one event-loop hop), and timeouts are
checked by the fleet's watchdog (`expire`) rather than by a timer per request.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class TransportError(Exception):
    """The control plane did not answer (refused, reset, timed out, or an answer that is not HTTP)."""


@dataclass(slots=True)
class Answer:
    """An HTTP answer: its status and body."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.content)


class _Wire(asyncio.Protocol):
    """One TCP connection's bytes in, parsed into answers for the request waiting on it."""

    __slots__ = ("buf", "closed", "transport", "waiter")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("the control plane closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_exception(exc)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        try:
            answer, used = _parse(buf, end)
        except ValueError as e:
            self._fail(e)
            return
        if answer is None:
            return
        del buf[:used]
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(answer)


def _parse(buf: bytearray, end: int) -> tuple[Answer | None, int]:
    """(the answer, bytes it took) when `buf` holds a whole one; (None, 0) when more must come first."""
    lines = bytes(buf[:end]).split(b"\r\n")
    status = int(lines[0].split(None, 2)[1])
    length, chunked, close = 0, False, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.strip().lower() == b"chunked"
        elif name == b"connection":
            close = value.strip().lower() == b"close"
    pos = end + 4
    if not chunked:
        if len(buf) < pos + length:
            return None, 0
        kind = _Closing if close else Answer
        return kind(status, bytes(buf[pos : pos + length])), pos + length
    content = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        if len(buf) < eol + 2 + size + 2:
            return None, 0
        content += buf[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
        if size == 0:
            break
    return (_Closing if close else Answer)(status, bytes(content)), pos


class _Closing(Answer):
    """An answer after which the server closes the connection."""


class Connection:
    """One keep-alive HTTP/1.1 connection to the control plane, opened on first use and after a failure.

    Only what the agent endpoints need: POST with a JSON body, answers with
    Content-Length or chunked. One request at a time (the fleet hands each
    connection to one node at a time).
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, watched: bool = False) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        self.authority = parts.netloc
        self.timeout_s = timeout_s
        # Whether something calls expire() (the fleet's watchdog): then a request needs no timer of its own.
        self.watched = watched
        self.wire: _Wire | None = None
        self.sent_at = 0.0
        self._heads: dict[str, bytes] = {}

    def _head(self, path: str) -> bytes:
        head = self._heads.get(path)
        if head is None:
            head = f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\nAuthorization: Bearer ".encode()
            self._heads[path] = head
        return head

    async def post(self, path: str, body: bytes, token: str, *, extra: bytes = b"") -> Answer:
        """POST `body` to `path` (`extra`: header lines, each after a CRLF); TransportError when no answer comes."""
        try:
            if self.watched:
                return await self._post(path, body, token, extra)
            async with asyncio.timeout(self.timeout_s):
                return await self._post(path, body, token, extra)
        except (OSError, TimeoutError, ValueError, IndexError) as e:
            self.close()
            raise TransportError(f"{self.authority}{path}: {type(e).__name__}: {e}") from e

    async def _post(self, path: str, body: bytes, token: str, extra: bytes) -> Answer:
        wire = self.wire
        loop = asyncio.get_running_loop()
        if wire is None or wire.closed:
            ctx = ssl.create_default_context() if self.https else None
            _, wire = await loop.create_connection(_Wire, self.host, self.port, ssl=ctx)
            self.wire = wire
        assert wire.transport is not None
        fut = wire.waiter = loop.create_future()
        self.sent_at = time.monotonic()
        wire.transport.write(
            b"".join(
                (
                    self._head(path),
                    token.encode(),
                    extra,
                    b"\r\nContent-Type: application/json\r\nContent-Length: ",
                    str(len(body)).encode(),
                    b"\r\n\r\n",
                    body,
                )
            )
        )
        answer = await fut
        self.sent_at = 0.0
        if isinstance(answer, _Closing):
            self.close()
        return answer

    def expire(self, now: float) -> None:
        """Fail the request in flight when it has waited past the timeout (the watchdog's call)."""
        wire = self.wire
        if self.sent_at and now - self.sent_at > self.timeout_s and wire is not None and wire.waiter is not None:
            wire._fail(TimeoutError(f"no answer within {self.timeout_s:g} s"))

    def close(self) -> None:
        """Drop the connection; the next request opens a new one."""
        if self.wire is not None and self.wire.transport is not None:
            self.wire.closed = True
            self.wire.transport.close()
        self.wire = None
        self.sent_at = 0.0
