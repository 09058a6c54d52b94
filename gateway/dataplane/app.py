"""The ASGI application: its routes, authentication, the request's checks, and the process's start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import re
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis
from django.conf import settings
from prometheus_client import generate_latest

from gateway import keys as gwkeys
from gateway import routing, usage
from gateway.dataplane import budgets
from gateway.dataplane.background import Background
from gateway.dataplane.catalog import Catalog
from gateway.dataplane.hold import Holder
from gateway.dataplane.http import (
    ClientGone,
    Native,
    Receive,
    Scope,
    Send,
    error_body,
    json_kind,
    request_id,
    send_json,
    send_raw,
    stamped,
)
from gateway.dataplane.limits import Limiter, Shared
from gateway.dataplane.metrics import Metrics
from gateway.dataplane.pool import Pool
from gateway.dataplane.streaming import Outcome, Relay
from gateway.dataplane.upstream import Health, Upstream
from gateway.table import KeyEntry, ModelRoute
from inventory.metrics import may_scrape
from llmgw import orphans
from llmgw_wire.engines import EngineLoad

log = logging.getLogger("gateway.dataplane")

MAX_BODY = 32 * 1024 * 1024
# Every JSON POST under /v1/ that names a model is routed by it (chat, completions, embeddings, responses,
# rerank, score, tokenize, ...): whether the engine serves the route is the engine's to say. No dots, so no "..".
PROXIED = re.compile(r"/v1/[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*")


@dataclass
class Answer:
    """What one request was answered: its status once sent, the model it named once known, whether it is counted."""

    status: int | None = None
    # The native server's ways past ASGI (its "llmgw.native" extension): None under another server.
    native: Native | None = None
    # Only a routed model's name: a client's arbitrary one would be a label of its own in /metrics.
    model: str = ""
    counted: bool = False

    def watch(self, send: Send) -> Send:
        """`send`, noting the status it starts the answer with."""

        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            await send(message)

        return watched


# The gateway's own failure, whatever its cause: still OpenAI's shape, never the server's plain text.
INTERNAL_ERROR = error_body(
    500, "the gateway failed on this request; its log names the x-request-id", "server_error", "internal_error"
)
# Probes, not API requests: not counted in llmgw_gateway_requests_total.
PROBES = ("/health", "/healthz", "/readyz", "/metrics")


class DataPlane(Background, Catalog, Holder, Upstream, Relay):
    """The ASGI application. One instance per process; state is this process's own."""

    def __init__(self) -> None:
        self.routes: dict[str, ModelRoute] = {}
        self.keys: dict[str, KeyEntry] = {}
        self.inflight: dict[str, int] = defaultdict(int)
        # Requests held per model at zero replicas, and each model's recent TTFTs (gateway/dataplane/hold.py).
        self.held: dict[str, int] = {}
        self.ttfts: dict[str, deque[tuple[float, float]]] = {}
        self.route_changed = asyncio.Event()
        self.health: dict[str, Health] = defaultdict(Health)
        # Each replica's engine figures and when they were read (monotonic).
        self.engine: dict[str, tuple[EngineLoad, float]] = {}
        self.scrape_failures: dict[str, tuple[int, float]] = {}
        self.reloaded_at = 0.0
        self.reload_took = 0.0
        self.routes_dirty = False
        self.routes_task: asyncio.Task | None = None
        self.metrics = Metrics()
        self.process_id = uuid.uuid4().hex[:12]
        self.client: httpx.AsyncClient | None = None
        # Requests to the replicas. Idle connections are let go before the engines' own
        # keep-alive timeout (uvicorn's 5 s, vLLM's server) closes them under a request.
        self.pool = Pool(
            connect_timeout=5.0,
            read_timeout=settings.LLMGW_GATEWAY_UPSTREAM_TIMEOUT,
            keepalive_expiry=4.0,
            max_idle=500,
            on_reopen=self.metrics.upstream_reopened.inc,
        )
        # Pub/sub: its reads block until a message comes, so no timeout.
        self.redis: aioredis.Redis | None = None
        # Limits, budgets and in-flight reports: short timeouts, and memory when Redis does not answer.
        self.shared = Shared(None, self.metrics)
        self.limiter = Limiter(self.shared, settings.LLMGW_CACHE_PREFIX)
        self.budgets = budgets.Budgets(self.shared, settings.LLMGW_CACHE_PREFIX)
        self.usage = usage.Accumulator()
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-db")
        self._tasks: list[asyncio.Task] = []
        self.loaded = asyncio.Event()
        self.round_robin = settings.LLMGW_GATEWAY_POLICY == "round-robin"
        self.turn = 0
        self.prefixes = routing.PrefixIndex(settings.LLMGW_GATEWAY_PREFIX_BLOCKS)

    async def startup(self) -> None:
        """Open the pools, load the table, start the background loops."""
        # A worker outliving its server's master would serve on beside its replacement.
        orphans.watch_parent()
        # The engines' figures, read once a second.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.LLMGW_GATEWAY_UPSTREAM_TIMEOUT, connect=5.0))
        if settings.REDIS_URL:
            self.redis = aioredis.Redis.from_url(settings.REDIS_URL)
            t = settings.LLMGW_CACHE_TIMEOUT
            self.shared.redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=t, socket_connect_timeout=t)
        try:
            await self.reload("all")
        except Exception:
            # A database that is down, or not migrated yet, must not keep the front door
            # from starting (and, under make run, take the other processes down with it):
            # it starts knowing no keys or replicas, and the periodic refresh fills them in.
            log.exception("gateway: could not load routes and keys at start; the periodic refresh will retry")
        self._tasks.append(asyncio.create_task(self._refresh_forever()))
        self._tasks.append(asyncio.create_task(self._flush_usage_forever()))
        self._tasks.append(asyncio.create_task(self._scrape_forever()))
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(self._listen_forever()))
        self._tasks.append(asyncio.create_task(self._report_inflight_forever()))

    async def shutdown(self) -> None:
        """Stop the loops, write the last usage, close the pools."""
        if self.routes_task is not None:
            self._tasks.append(self.routes_task)
            self.routes_task = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self._flush_usage(asyncio.get_running_loop())
        if self.client is not None:
            await self.client.aclose()
        await self.pool.aclose()
        with contextlib.suppress(Exception):
            await self._report_inflight(None)
        for client in (self.redis, self.shared.redis):
            if client is not None:
                await client.aclose()
        self._db.shutdown(wait=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        rid = request_id(scope)
        # Every answer carries the request's id; the rate-limit headers join them once the key is counted.
        extra = [(b"x-request-id", rid)]
        answer = Answer(native=(scope.get("extensions") or {}).get("llmgw.native"))
        send = answer.watch(stamped(send, extra))
        failed = False
        try:
            await self._answer(scope, receive, send, path, method, rid, extra, answer)
        except Exception:
            failed = True
            log.exception("gateway: %s %s failed (x-request-id %s)", method, path, rid.decode("latin-1"))
            if answer.status is None:
                with contextlib.suppress(Exception):
                    await send_raw(send, 500, INTERNAL_ERROR)
        finally:
            # Every answer but the probes' is counted once: the forwarded ones where they are relayed, the rest here.
            # A client that left before any answer is not counted.
            if not answer.counted and (failed or answer.status) and not (method == "GET" and path in PROBES):
                self.metrics.child(self.metrics.requests, answer.model, "500" if failed else str(answer.status)).inc()

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        method: str,
        rid: bytes,
        extra: list[tuple[bytes, bytes]],
        answer: Answer,
    ) -> None:
        if path in ("/health", "/healthz") and method == "GET":
            await send_json(send, 200, {"status": "ok", "models": len(self.routes)})
            return
        if path == "/readyz" and method == "GET":
            # Ready once the keys and routes were read at least once: before that every key is
            # unknown and every client would get a 401. Afterwards a database outage keeps the
            # last table serving, so it stays ready.
            if self.loaded.is_set():
                await send_json(send, 200, {"status": "ok", "models": len(self.routes)})
            else:
                await send_json(send, 503, {"status": "unavailable", "failed": ["routes"]})
            return
        if path == "/metrics" and method == "GET":
            await self._metrics(scope, send)
            return
        key = self._authenticate(scope)
        if isinstance(key, bytes):
            await send_raw(send, 401, key)
            return
        if path == "/v1/models" and method == "GET":
            await self._models(send, key)
            return
        if path.startswith("/v1/models/") and method == "GET":
            await self._model(send, key, path.removeprefix("/v1/models/"))
            return
        if method == "POST" and PROXIED.fullmatch(path):
            await self._proxy(receive, send, key, path, rid, extra, answer)
            return
        await send_raw(send, 404, error_body(404, f"no route {method} {path}", "invalid_request_error", "not_found"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    log.exception("gateway: start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authenticate(self, scope: Scope) -> KeyEntry | bytes:
        header = b""
        for k, v in scope["headers"]:
            if k == b"authorization":
                header = v
                break
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return error_body(
                401, "missing API key: send Authorization: Bearer <key>", "authentication_error", "missing_api_key"
            )
        entry = self.keys.get(gwkeys.hash_secret(token.strip()))
        if entry is None:
            return error_body(401, "invalid or revoked API key", "authentication_error", "invalid_api_key")
        if entry.expired(dt.datetime.now(dt.UTC)):
            return error_body(401, f"API key {entry.name!r} has expired", "authentication_error", "expired_api_key")
        return entry

    async def _metrics(self, scope: Scope, send: Send) -> None:
        # It names every model and replica and counts their traffic, on the port every client reaches:
        # guarded as the control plane's /metrics is (its token or an allowed address; no user here).
        authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        client = scope.get("client")
        if not may_scrape(authorization=authorization, remote_addr=client[0] if client else None):
            await send_raw(
                send,
                401,
                error_body(
                    401, "metrics need a bearer token or an allowed address", "authentication_error", "metrics_refused"
                ),
                [(b"www-authenticate", b'Bearer realm="llmgw-metrics"')],
            )
            return
        # Every routed replica, so one whose requests all finished reads 0, not its last count.
        routed = {b.id for route in self.routes.values() for b in route.backends}
        for rid in routed | set(self.inflight):
            self.metrics.inflight.labels(rid).set(self.inflight.get(rid, 0))
        now = time.monotonic()
        # Every routed replica too, 0 until it is ejected: a panel of them is never empty.
        for rid in routed | set(self.health):
            h = self.health.get(rid)
            self.metrics.ejected.labels(rid).set(1 if h is not None and h.ejected_until > now else 0)
        body = generate_latest(self.metrics.registry)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, None when it is over MAX_BODY; TimeoutError past LLMGW_BODY_TIMEOUT.

        A client trickling its body a byte at a time would otherwise hold its
        connection, its buffers and its place in the in-flight counts for as
        long as it likes.
        """
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(settings.LLMGW_BODY_TIMEOUT):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > MAX_BODY:
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)

    async def _proxy(
        self,
        receive: Receive,
        send: Send,
        key: KeyEntry,
        path: str,
        rid: bytes,
        extra: list[tuple[bytes, bytes]],
        answer: Answer,
    ) -> None:
        started = time.monotonic()
        try:
            raw = await self._read_body(receive)
        except ClientGone:
            return
        except TimeoutError:
            message = f"the body did not arrive within {settings.LLMGW_BODY_TIMEOUT:g} s"
            await send_raw(
                send,
                408,
                error_body(408, message, "invalid_request_error", "body_timeout"),
                [(b"connection", b"close")],
            )
            return
        if raw is None:
            await send_raw(
                send, 413, error_body(413, f"body over {MAX_BODY} bytes", "invalid_request_error", "too_large")
            )
            return
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError):
            await send_raw(send, 400, error_body(400, "body is not JSON", "invalid_request_error", "invalid_json"))
            return
        except RecursionError:
            # Arrays nested thousands deep: the parser's own recursion ran out, which is the client's doing.
            message = "the body nests arrays or objects too deeply"
            await send_raw(send, 400, error_body(400, message, "invalid_request_error", "invalid_json"))
            return
        if not isinstance(body, dict):
            message = f"the body must be a JSON object, not {json_kind(body)}"
            await send_raw(send, 400, error_body(400, message, "invalid_request_error", "invalid_body"))
            return
        model = body.get("model")
        if not isinstance(model, str) or not model:
            await send_raw(
                send,
                400,
                error_body(400, "model: required, a string", "invalid_request_error", "invalid_value", "model"),
            )
            return
        route = self.routes.get(model)
        if route is None:
            await send_raw(
                send,
                404,
                error_body(
                    404, f"the model {model!r} does not exist", "invalid_request_error", "model_not_found", "model"
                ),
            )
            return
        answer.model = model
        if not key.allows(model):
            await send_raw(
                send,
                403,
                error_body(
                    403, f"API key {key.name!r} may not use {model!r}", "permission_error", "model_not_allowed", "model"
                ),
            )
            return
        spent = await self.budgets.admit(key, time.time())
        if spent is not None:
            answer.counted = True
            self.metrics.requests.labels(model, "429").inc()
            self.usage.add(key.id, model, time.time(), error=True)
            await send_raw(send, 429, spent.body, spent.headers)
            return
        wall = time.time()
        window = await self.limiter.admit(key, wall)
        if window is not None:
            extra += window.headers()
        if window is not None and window.retry_after is not None:
            answer.counted = True
            self.metrics.requests.labels(model, "429").inc()
            self.usage.add(key.id, model, wall, error=True)
            await send_raw(
                send,
                429,
                error_body(
                    429,
                    f"API key {key.name!r} is over its limit for this minute",
                    "rate_limit_error",
                    "rate_limit_exceeded",
                ),
                [(b"retry-after", str(math.ceil(window.retry_after)).encode())],
            )
            return

        async def spend(o: Outcome) -> None:
            await self.limiter.spend(key, o.prompt_tokens + o.completion_tokens, time.time())
            await self.budgets.spend(key, o.prompt_tokens + o.completion_tokens, time.time())

        out = await self._forward(receive, send, route, body, raw, path, started, spend, rid, answer.native)
        await out.settle_once()
        answer.counted = True
        m = self.metrics
        m.child(m.requests, model, str(out.code)).inc()
        if out.prompt_tokens:
            m.child(m.tokens, model, "prompt").inc(out.prompt_tokens)
        if out.completion_tokens:
            m.child(m.tokens, model, "completion").inc(out.completion_tokens)
        if out.ttft is not None:
            m.child(m.ttft, model).observe(out.ttft)
            self.saw_ttft(model, out.ttft)
        m.child(m.duration, model).observe(time.monotonic() - started)
        self.usage.add(
            key.id,
            model,
            wall,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            error=out.error,
            ttft=out.ttft,
        )


def make_app() -> DataPlane:
    """A data plane for this process (DJANGO_SETTINGS_MODULE must be set up)."""
    log.info("gateway data plane %s starting (pid %d)", "llmgw", os.getpid())
    return DataPlane()
