"""An HTTP/1.1 server for an ASGI application on one event loop: the gateway's native way of serving.

Under granian each request's messages cross between its Rust threads and
the event loop's thread, and each crossing wakes the loop: in a profile of
the data plane the polling, the hand-overs and granian's own threads took
three quarters of a worker's CPU, llmgw's code 8 %. Here the socket is read,
parsed (httptools, llhttp's C parser) and written on the loop's own thread,
in the callbacks the loop already runs, so a request costs the application
one task and no hand-over.

What it keeps of a server's job: keep-alive and pipelined requests (answered
in order), request bodies framed by length or chunks and read as they
arrive (reading pauses while the application is behind), answers framed by
their length or chunked, a request head that does not arrive within
`head_timeout` answered 408 (the body's own deadline is the application's),
idle connections closed after IDLE_S, and a graceful stop that lets the
requests in hand finish. No TLS, no HTTP/2, no WebSocket: a reverse proxy
terminates those, as before granian.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from email.utils import formatdate
from typing import Any

import uvloop

from gateway.dataplane.connection import Connection
from gateway.dataplane.lifespan import Lifespan

log = logging.getLogger("gateway.server")

# Seconds a kept-alive connection may sit idle between requests.
IDLE_S = 60.0
# How long a stop lets the requests in hand finish before cancelling them (within llmgw/orphans.py's grace).
GRACE_S = 8.0
# How long a stop leaves an idle kept-alive connection open. Closed at once, it raced the request its
# client was sending on it, and that request was reset; left open, that request is answered with
# "Connection: close" and the client's next one goes to a connection of the worker that stays.
LINGER_S = 0.5


class Server:
    """One worker's connections, the application they run, and what they share: the date line, the stop."""

    def __init__(self, app: Any, *, head_timeout: float, access_log: bool = False) -> None:
        self.app = app
        self.head_timeout = head_timeout
        self.access_log = access_log
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.address: tuple[str, int] | None = None
        self.date = b""
        self._tick()

    def _tick(self) -> None:
        # Once a second, not once an answer: formatting the date was a tenth of a small answer's cost.
        self.date = b"date: %b\r\n" % formatdate(usegmt=True).encode()

    async def serve(self, sock: socket.socket, stop: asyncio.Event) -> None:
        """Run the lifespan, then serve on the listening `sock` until `stop` is set; then stop gracefully."""
        self.loop = asyncio.get_running_loop()
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        sweep: asyncio.Task | None = None
        try:
            listener = await self.loop.create_server(lambda: Connection(self), sock=sock)
            self.address = sock.getsockname()[:2]
            sweep = self.loop.create_task(self._sweep())
            await stop.wait()
            await self._stop(listener)
        finally:
            if sweep is not None:
                sweep.cancel()
            await lifespan.shutdown()

    async def _sweep(self) -> None:
        # One pass a second over the connections instead of a timer per request: a timer set and
        # cancelled on every request is work each request pays for a deadline almost none reaches.
        while True:
            await asyncio.sleep(1.0)
            self._tick()
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.head_since:
                    if now - conn.head_since > self.head_timeout:
                        conn.refuse(408)
                elif conn.current is None and not conn.pending and now - conn.idle_since > IDLE_S:
                    conn.close()

    async def _stop(self, listener: asyncio.AbstractServer) -> None:
        self.stopping = True
        listener.close()
        start = time.monotonic()
        end = start + GRACE_S
        while time.monotonic() < end:
            lingered = time.monotonic() - start >= LINGER_S
            if lingered:
                self._close_idle()
            if lingered and not self.tasks:
                break
            await asyncio.sleep(0.05)
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for conn in list(self.connections):
            conn.close()

    def _close_idle(self) -> None:
        for conn in list(self.connections):
            if conn.current is None and not conn.head_since and not conn.pending:
                conn.close()


def run(app: Any, sock: socket.socket, *, head_timeout: float, access_log: bool = False) -> None:
    """Serve `app` on the listening `sock` on a uvloop event loop until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Server(app, head_timeout=head_timeout, access_log=access_log).serve(sock, stop)

    uvloop.run(main())
