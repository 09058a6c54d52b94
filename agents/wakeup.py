"""GET /api/v1/agent/wait: the long-poll an agent holds open to hear, at once, that work waits for it.

Commands ride on heartbeats, every few seconds; with this an agent learns
within a few milliseconds of the commit that a command was queued
(inventory/wakeups.py publishes the node's channel) and heartbeats at once
to fetch it. Answers: 200 `{"work": true}` when the node's channel was
published while it waited (or shortly before it came back), 204 after
LLMGW_AGENT_WAIT_S seconds (default 25) of nothing, 401 without a
credential of the node named by `?node=`.

With Redis, the process holds one pattern subscription to every node's
channel (Hub). Without it (the embedded default, `make run`), nothing is
published, so the process looks in the command outbox itself a few times a
second for commands not yet delivered to the nodes that wait (DatabaseHub):
one small query per look, only while some node waits. Either way the
long-poll is on whenever the gateway runs.

It is ASGI, not a view of the WSGI web app: a long-poll there would pin one
of its few threads per node for the whole wait, while here ten thousand
idle waits are ten thousand small coroutines. `with_agent_wakeup` mounts it
in front of the gateway's data plane (gateway/asgi.py), the ASGI process
`make run` already starts; a reverse proxy in front of the control plane
sends this one path there. The credential is checked once per request, one
indexed query in a worker thread; the process holds one Redis connection
(a pattern subscription to every node's channel) and hands each message to
the coroutines waiting for that node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections

from agents import credentials
from inventory import wakeups
from inventory.models import Command

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

WAIT_PATH = "/api/v1/agent/wait"
# A wakeup that found the node between two polls (busy with the heartbeat the
# previous wakeup asked for) is kept this long for its next poll.
REMEMBER_S = 10.0
MAX_REMEMBERED = 100_000


class Hub:
    """This process's one Redis subscription, fanned out to the long-polls waiting on each node."""

    def __init__(self, redis_url: str, prefix: str, *, remember_s: float = REMEMBER_S) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.remember_s = remember_s
        self.waiters: dict[str, set[asyncio.Future[bool]]] = {}
        # Node -> when (monotonic) a wakeup came that nobody was waiting for.
        self.missed: dict[str, float] = {}
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start listening (once, in the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen_forever())

    async def close(self) -> None:
        """Stop listening."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _listen_forever(self) -> None:
        backoff = 0.5
        while True:
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                pubsub = client.pubsub()
                await pubsub.psubscribe(self.prefix + "*")
                self.subscribed.set()
                backoff = 0.5
                async for message in pubsub.listen():
                    if message.get("type") != "pmessage":
                        continue
                    name = message["channel"]
                    name = name.decode() if isinstance(name, bytes) else str(name)
                    self.deliver(name[len(self.prefix) :])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # While unsubscribed, wakeups are lost: agents fall back to their interval.
                self.subscribed.clear()
                log.warning("agent wakeup: Redis subscription lost (%s); again in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()

    def deliver(self, node_id: str) -> int:
        """Wake the long-polls waiting on a node; how many. Remembered for its next poll when none waits."""
        futures = self.waiters.pop(node_id, None)
        woken = 0
        for f in futures or ():
            if not f.done():
                f.set_result(True)
                woken += 1
        if not woken:
            now = time.monotonic()
            if len(self.missed) >= MAX_REMEMBERED:
                self.missed = {n: t for n, t in self.missed.items() if now - t < self.remember_s}
            self.missed[node_id] = now
        return woken

    async def wait(self, node_id: str, timeout: float, *, gone: Callable[[], Awaitable[Any]] | None = None) -> bool:
        """True when the node's channel is published within `timeout` seconds (or was, just before).

        `gone` returns when the client has left, which ends the wait early.
        """
        seen = self.missed.pop(node_id, None)
        if seen is not None and time.monotonic() - seen < self.remember_s:
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        # One wait per node: an agent that reconnected leaves no older wait behind.
        for older in self.waiters.pop(node_id, ()):
            if not older.done():
                older.set_result(False)
        self.waiters[node_id] = {future}
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            waiting = {future} if watcher is None else {future, watcher}
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return future.done() and not future.cancelled() and future.result()
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
            mine = self.waiters.get(node_id)
            if mine is not None:
                mine.discard(future)
                if not mine:
                    del self.waiters[node_id]


# How often the database hub looks for undelivered commands: a command waits at most this long.
DB_POLL_S = 0.2
# Node ids per query (SQLite allows 999 parameters in older builds).
DB_CHUNK = 500


def undelivered(node_ids: list[str]) -> dict[str, set[str]]:
    """The ids of commands queued for these nodes and not yet handed to them, by node (in a worker thread)."""
    close_old_connections()
    found: dict[str, set[str]] = {}
    try:
        for i in range(0, len(node_ids), DB_CHUNK):
            rows = Command.objects.filter(
                node_id__in=node_ids[i : i + DB_CHUNK], first_delivered_at__isnull=True, acked_at__isnull=True
            ).values_list("node_id", "id")
            for node_id, command_id in rows:
                found.setdefault(node_id, set()).add(str(command_id))
    finally:
        close_old_connections()
    return found


class DatabaseHub(Hub):
    """The hub without Redis: the outbox itself, read a few times a second while some node waits.

    A node is woken once per command: a command announced and not yet
    fetched (the agent's heartbeat is on its way) does not wake it again.
    """

    def __init__(self, *, executor: ThreadPoolExecutor, poll_s: float = DB_POLL_S) -> None:
        super().__init__("", "")
        self.poll_s = poll_s
        self.executor = executor
        # Node -> the undelivered commands it was already woken for.
        self.announced: dict[str, set[str]] = {}

    async def _listen_forever(self) -> None:
        self.subscribed.set()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.poll_s)
            waiting = sorted(self.waiters)
            if not waiting:
                continue
            try:
                pending = await loop.run_in_executor(self.executor, undelivered, waiting)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # The database hiccuped: agents keep to their interval until it answers again.
                log.warning("agent wakeup: could not read the outbox (%s)", e)
                continue
            for node_id in waiting:
                ids = pending.get(node_id, set())
                if ids - self.announced.get(node_id, set()):
                    self.deliver(node_id)
                if ids:
                    self.announced[node_id] = ids
                else:
                    self.announced.pop(node_id, None)


def _authenticate(token: str) -> str | None:
    """The node a credential belongs to (in a worker thread: Django's ORM is synchronous)."""
    close_old_connections()
    try:
        auth = credentials.authenticate_node(token)
    finally:
        close_old_connections()
    return auth.node_id if auth is not None else None


class WaitEndpoint:
    """The ASGI application answering GET /api/v1/agent/wait."""

    def __init__(self, *, hold_s: float | None = None, redis_url: str | None = None) -> None:
        self.hold_s = hold_s if hold_s is not None else settings.LLMGW_AGENT_WAIT_S
        self.redis_url = settings.REDIS_URL if redis_url is None else redis_url
        self.hub: Hub | None = None
        # A few threads: a burst of reconnecting agents queues here rather than
        # opening a database connection each.
        self._db = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent-wakeup-db")

    def _hub(self) -> Hub:
        if self.hub is None:
            if self.redis_url:
                self.hub = Hub(self.redis_url, wakeups.channel_prefix())
            else:
                self.hub = DatabaseHub(executor=self._db)
            self.hub.start()
        return self.hub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await _answer(send, 405, {"detail": "use GET"}, [(b"allow", b"GET")])
            return
        token = credentials.bearer(_header(scope, b"authorization"))
        node_id = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("node", [""])[0]
        owner = None
        if token and token.startswith(credentials.NODE_PREFIX):
            loop = asyncio.get_running_loop()
            owner = await loop.run_in_executor(self._db, _authenticate, token)
        # A credential of another node is refused like none at all: a stranger learns nothing.
        if owner is None or owner != node_id:
            await _answer(
                send, 401, {"detail": "a node credential for ?node= is required"}, [(b"www-authenticate", b"Bearer")]
            )
            return
        work = await self._hub().wait(node_id, self.hold_s, gone=lambda: _disconnected(receive))
        # Every node holds one of these at all times: routine, like its lease.
        log.debug("agent wait: node %s %s", node_id, "has work" if work else "heard nothing")
        if work:
            await _answer(send, 200, {"work": True})
        else:
            await _answer(send, 204, None)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (an agent restarted mid-wait)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


async def _answer(send: Send, status: int, body: dict | None, extra: list[tuple[bytes, bytes]] = ()) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-length", str(len(data)).encode()), *extra]
    if body is not None:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def mount_path(app: ASGIApp, path: str, endpoint: ASGIApp) -> ASGIApp:
    """An ASGI application: HTTP requests for `path` to `endpoint`, everything else (lifespan too) to `app`."""

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == path:
            await endpoint(scope, receive, send)
            return
        await app(scope, receive, send)

    return dispatch


def with_agent_wakeup(app: ASGIApp, *, endpoint: WaitEndpoint | None = None) -> ASGIApp:
    """An ASGI application answering WAIT_PATH itself and passing everything else (lifespan too) to `app`."""
    wait = endpoint or WaitEndpoint()
    dispatch = mount_path(app, WAIT_PATH, wait)
    dispatch.wait_endpoint = wait  # type: ignore[attr-defined]
    return dispatch
