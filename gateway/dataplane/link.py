"""One connection to a replica, as the event loop's protocol: read into a buffer, or passed straight to a sink.

asyncio's StreamReader wakes the reading task once for every read: on a
streamed answer that is a future, a task step and two async generators for
each token the engine sends, and in a profile of the data plane relaying
long chats that was most of its own Python. Here the head and whole answers
are read as before (await a read), but while a stream is relayed its bytes
go from the loop's read callback to the client's connection with no task
woken until the stream ends (pool.Response.relay).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Bytes buffered unread before the replica's connection stops being read.
HIGH_WATER = 256 * 1024


class Link(asyncio.Protocol):
    """A replica's connection: its bytes buffered for `read` and `readuntil`, or handed to `sink` as they come."""

    __slots__ = ("buf", "eof", "error", "loop", "paused", "sink", "transport", "waiter", "write_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.write_waiter: asyncio.Future | None = None
        # Reading paused: the buffer is full, or the client a stream goes to is behind (hold).
        self.paused = False
        # Called with each read's bytes instead of buffering them, and with b"" at the connection's end.
        self.sink: Callable[[bytes], None] | None = None

    # The loop's callbacks.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Connected."""
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        """Bytes from the replica: to the sink, or into the buffer for the read waiting."""
        if self.sink is not None:
            self.sink(data)
            return
        self.buf += data
        if len(self.buf) > HIGH_WATER:
            self.hold()
        self._wake()

    def eof_received(self) -> bool:
        """The replica has closed its side: the connection is closed too."""
        self.eof = True
        self._end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection has ended (closed, reset)."""
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._end()
        w, self.write_waiter = self.write_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def pause_writing(self) -> None:
        """The replica is behind reading a large request body."""
        if self.write_waiter is None:
            self.write_waiter = self.loop.create_future()

    def resume_writing(self) -> None:
        """It has caught up."""
        w, self.write_waiter = self.write_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self) -> None:
        sink = self.sink
        if sink is not None:
            self.sink = None
            sink(b"")
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # The caller's side.

    def is_closing(self) -> bool:
        """The connection is closed or closing."""
        return self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        """Send `data` to the replica."""
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the replica has taken what was written (or the connection is gone)."""
        if self.error is not None:
            raise self.error
        if self.write_waiter is not None:
            await self.write_waiter
            if self.error is not None:
                raise self.error

    def hold(self) -> None:
        """Stop reading the replica until `release`."""
        if not self.paused and not self.is_closing():
            self.paused = True
            self.transport.pause_reading()

    def release(self) -> None:
        """Read the replica again."""
        if self.paused and not self.is_closing():
            self.paused = False
            self.transport.resume_reading()

    async def _wait(self) -> None:
        self.release()
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _raise_lost(self) -> None:
        if isinstance(self.error, OSError):
            raise self.error

    async def readuntil(self, separator: bytes, limit: int) -> bytes:
        """Bytes up to and including `separator`; IncompleteReadError at the end, ValueError past `limit`."""
        start = 0
        while True:
            at = self.buf.find(separator, start)
            if at >= 0:
                end = at + len(separator)
                if end > limit:
                    raise ValueError(f"over {limit} bytes before {separator!r}")
                data = bytes(self.buf[:end])
                del self.buf[:end]
                return data
            if len(self.buf) > limit:
                raise ValueError(f"over {limit} bytes before {separator!r}")
            if self.eof:
                self._raise_lost()
                partial = bytes(self.buf)
                self.buf.clear()
                raise asyncio.IncompleteReadError(partial, None)
            start = max(0, len(self.buf) - len(separator) + 1)
            await self._wait()

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes, waiting for some; b"" once the replica has closed and nothing is left."""
        while not self.buf:
            if self.eof:
                self._raise_lost()
                return b""
            await self._wait()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def take(self) -> bytes:
        """What is buffered, at once (the bytes that came with an answer's head)."""
        data = bytes(self.buf)
        self.buf.clear()
        self.release()
        return data

    def close(self) -> None:
        """Close the connection."""
        self.sink = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
