"""An ASGI application's lifespan, run by a server that is not an ASGI server's own loop (RSGI, the native server).

The application's pools, table and background loops start before the first
request is taken, and its last usage is written when the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger("gateway.dataplane")

# How long a worker's stop waits for the application's lifespan shutdown (the last usage written).
SHUTDOWN_TIMEOUT = 30.0


class Lifespan:
    """One ASGI application's lifespan: `startup()` before serving, `shutdown()` after."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._messages: asyncio.Queue[dict[str, Any]] | None = None
        self._started: asyncio.Future[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        """Run the application's lifespan startup; raise if it reports a failure."""
        loop = asyncio.get_running_loop()
        self._messages = asyncio.Queue()
        self._started, self._stopped = loop.create_future(), loop.create_future()
        self._messages.put_nowait({"type": "lifespan.startup"})
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = loop.create_task(self.app(scope, self._messages.get, self._send))
        self._task.add_done_callback(self._ended)
        await self._started

    async def shutdown(self) -> None:
        """Run the application's lifespan shutdown, waiting for it at most SHUTDOWN_TIMEOUT."""
        if self._messages is None or self._stopped is None or self._stopped.done():
            return
        self._messages.put_nowait({"type": "lifespan.shutdown"})
        try:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT):
                await self._stopped
        except TimeoutError:
            log.warning("gateway: the lifespan shutdown did not finish within %g s", SHUTDOWN_TIMEOUT)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete" and not self._started.done():
            self._started.set_result(None)
        elif kind == "lifespan.startup.failed" and not self._started.done():
            self._started.set_exception(RuntimeError(message.get("message") or "lifespan startup failed"))
        elif kind == "lifespan.shutdown.complete" and not self._stopped.done():
            self._stopped.set_result(None)

    def _ended(self, task: asyncio.Task) -> None:
        # An application without a lifespan (it returns or raises on the scope) starts as it is.
        for future in (self._started, self._stopped):
            if future is not None and not future.done():
                future.set_result(None)
