"""Hostile clients for the fault suite and the tests: bodies trickled a byte at a time.

`Trickle` opens many connections to one server, sends each a request's head
promising a large body, then one byte of that body per connection every
`every_s` seconds, for as long as the server keeps the connection open. It
records, per connection, when the server closed it and the status line it
answered with, if any. A server that holds a thread per such connection
stops answering anyone else; one that reads bodies on an event loop, with
a deadline, answers each with a 408 and closes it.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field


def request_head(
    path: str, *, host: str = "localhost", length: int = 1_000_000, headers: dict[str, str] | None = None
) -> bytes:
    """A POST's head promising a JSON body of `length` bytes, with its first bytes."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + b'{"node_id": '


@dataclass
class Conn:
    """One trickling connection: what the server answered and when it closed the connection (monotonic)."""

    sock: socket.socket
    answer: bytes = b""
    closed_at: float | None = None

    @property
    def status(self) -> int | None:
        """The status of the server's answer, None when it answered nothing."""
        parts = self.answer.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


@dataclass
class Trickle:
    """`n` connections to host:port, each sending `head` then one byte every `every_s` seconds."""

    host: str
    port: int
    head: bytes
    n: int = 100
    every_s: float = 0.5
    conns: list[Conn] = field(default_factory=list)
    started_at: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Trickle:
        """Open every connection and send its head; the trickle goes on in a thread."""
        self.started_at = time.monotonic()
        for _ in range(self.n):
            s = socket.create_connection((self.host, self.port), timeout=10)
            s.sendall(self.head)
            s.setblocking(False)
            self.conns.append(Conn(s))
        self._thread = threading.Thread(target=self._run, name="trickle", daemon=True)
        self._thread.start()
        return self

    def open(self) -> int:
        """How many connections the server still holds."""
        return sum(1 for c in self.conns if c.closed_at is None)

    def statuses(self) -> dict[int | None, int]:
        """How many connections were answered with each status (None: closed without an answer, or still open)."""
        out: dict[int | None, int] = {}
        for c in self.conns:
            out[c.status] = out.get(c.status, 0) + 1
        return out

    def held_s(self) -> float:
        """The longest any closed connection was held, from the start (0 when none closed)."""
        return max((c.closed_at - self.started_at for c in self.conns if c.closed_at), default=0.0)

    def stop(self) -> None:
        """Stop trickling and close what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.sock.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for c in self.conns:
            sel.register(c.sock, selectors.EVENT_READ, c)
        next_byte = time.monotonic() + self.every_s
        while not self._stop.is_set() and self.open():
            for key, _ in sel.select(timeout=0.05):
                c: Conn = key.data
                try:
                    data = c.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    c.answer += data
                    continue
                c.closed_at = time.monotonic()
                sel.unregister(c.sock)
            if time.monotonic() >= next_byte:
                next_byte += self.every_s
                for c in self.conns:
                    if c.closed_at is not None:
                        continue
                    try:
                        c.sock.send(b" ")
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        # Reset by the server: closed, whatever it answered before.
                        c.closed_at = time.monotonic()
                        with contextlib.suppress(KeyError, ValueError):
                            sel.unregister(c.sock)
        sel.close()
