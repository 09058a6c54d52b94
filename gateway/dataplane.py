"""The gateway's data plane: an ASGI application that routes OpenAI-style requests to ready replicas.

It holds the routing table and the key hashes in memory (gateway/table.py),
reloaded in a worker thread at start, when a push arrives on Redis
(gateway/notify.py), and every LLMGW_GATEWAY_REFRESH seconds; a request
never touches the database. Limits are counted in Redis so that every
gateway process agrees.

Streams are passed through chunk by chunk as they arrive. A client that
disconnects cancels the upstream request at once (its connection is closed).
A connection error or a 5xx before the first byte is retried once on another
replica; once a byte has reached the client nothing is retried. A replica
failing LLMGW_GATEWAY_EJECT_AFTER times in a row is ejected for
LLMGW_GATEWAY_EJECT_FOR seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway import figures, notify, routing, usage
from gateway import keys as gwkeys
from gateway.enginemetrics import EngineLoad, names_for, parse
from gateway.table import Backend, KeyEntry, ModelRoute, load_keys, load_routes
from placement import inflight as placement_inflight

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_BODY = 32 * 1024 * 1024
PROXIED = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding"}
# How often this process tells the reconciler its in-flight requests per replica.
INFLIGHT_REPORT_S = 0.5


class ClientGone(Exception):
    """The client closed its connection while we were answering."""


@dataclass
class Outcome:
    """What one proxied request came to, for metrics, limits and usage."""

    code: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    error: bool = False
    # Called once the usage is known and before the answer's end reaches the
    # client, so a client's next request sees this one's tokens counted.
    settle: Callable[[Outcome], Awaitable[None]] | None = None
    settled: bool = False

    async def settle_once(self) -> None:
        """Run `settle` if it has not run yet."""
        if self.settle is not None and not self.settled:
            self.settled = True
            await self.settle(self)


@dataclass
class _Health:
    """A replica's recent failures as this process saw them."""

    failures: int = 0
    ejected_until: float = 0.0


@dataclass
class _Limiter:
    """Per-key, per-minute counters: Redis when there is one (shared), this process's memory otherwise."""

    redis: aioredis.Redis | None
    prefix: str
    local: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _k(self, kind: str, key_id: int, minute: int) -> str:
        return f"{self.prefix}:gw:{kind}:{key_id}:{minute}"

    async def admit(self, key: KeyEntry, now: float) -> float | None:
        """Count a request against its key; the seconds to wait (Retry-After) when over a limit, else None."""
        if not key.rpm_limit and not key.tpm_limit:
            return None
        minute = int(now // 60)
        retry = 60 - (now % 60)
        rpm_k, tpm_k = self._k("rpm", key.id, minute), self._k("tpm", key.id, minute)
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incr(rpm_k)
            pipe.expire(rpm_k, 120)
            pipe.get(tpm_k)
            requests, _, tokens = await pipe.execute()
            tokens = int(tokens or 0)
        else:
            self.local[rpm_k] += 1
            requests, tokens = self.local[rpm_k], self.local.get(tpm_k, 0)
        if key.rpm_limit and int(requests) > key.rpm_limit:
            return retry
        if key.tpm_limit and tokens >= key.tpm_limit:
            return retry
        return None

    async def spend(self, key: KeyEntry, tokens: int, now: float) -> None:
        """Add a finished request's tokens to its key's minute."""
        if not key.tpm_limit or tokens <= 0:
            return
        k = self._k("tpm", key.id, int(now // 60))
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incrby(k, tokens)
            pipe.expire(k, 120)
            await pipe.execute()
        else:
            self.local[k] += tokens


def _error_body(status: int, message: str, kind: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class Metrics:
    """The gateway's Prometheus families, on a registry of this process's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered, by model and status code",
            ["model", "code"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmgw_gateway_tokens",
            "Tokens the engines reported, by model and kind",
            ["model", "kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmgw_gateway_ttft_seconds",
            "Time from the request to its first byte from the replica",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmgw_gateway_request_seconds",
            "Time from the request to its last byte",
            ["model"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "llmgw_gateway_inflight", "Requests in flight to each replica", ["replica"], registry=self.registry
        )
        self.ejected = Gauge(
            "llmgw_gateway_replica_ejected",
            "1 while a replica is ejected after repeated failures",
            ["replica"],
            registry=self.registry,
        )
        self.retries = Counter(
            "llmgw_gateway_retries", "Requests retried on another replica before the first byte", registry=self.registry
        )


class DataPlane:
    """The ASGI application. One instance per process; state is this process's own."""

    def __init__(self) -> None:
        self.routes: dict[str, ModelRoute] = {}
        self.keys: dict[str, KeyEntry] = {}
        self.inflight: dict[str, int] = defaultdict(int)
        self.health: dict[str, _Health] = defaultdict(_Health)
        # Each replica's engine figures and when they were read (monotonic).
        self.engine: dict[str, tuple[EngineLoad, float]] = {}
        self.metrics = Metrics()
        self.process_id = uuid.uuid4().hex[:12]
        self.client: httpx.AsyncClient | None = None
        self.redis: aioredis.Redis | None = None
        self.limiter = _Limiter(None, settings.LLMGW_CACHE_PREFIX)
        self.usage = usage.Accumulator()
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-db")
        self._tasks: list[asyncio.Task] = []
        self.loaded = asyncio.Event()
        self.round_robin = settings.LLMGW_GATEWAY_POLICY == "round-robin"
        self.turn = 0

    # ---- the table -------------------------------------------------------

    def _load(self, kind: str) -> tuple[dict[str, ModelRoute] | None, dict[str, KeyEntry] | None]:
        close_old_connections()
        try:
            routes = load_routes() if kind in ("routes", "all") else None
            keys = load_keys() if kind in ("keys", "all") else None
        finally:
            close_old_connections()
        return routes, keys

    async def reload(self, kind: str = "all") -> None:
        """Reload the routing table, the keys or both from the database, in the worker thread."""
        loop = asyncio.get_running_loop()
        routes, keys = await loop.run_in_executor(self._db, self._load, kind)
        if routes is not None:
            self.routes = routes
        if keys is not None:
            self.keys = keys
        self.loaded.set()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(settings.LLMGW_GATEWAY_REFRESH)
            try:
                await self.reload("all")
            except Exception:
                log.exception("gateway: periodic refresh failed; keeping the last table")

    async def _listen_forever(self) -> None:
        assert self.redis is not None
        backoff = 0.5
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(notify.channel())
                # Anything missed while (re)subscribing is caught by loading it all now.
                await self.reload("all")
                backoff = 0.5
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        kind = json.loads(message["data"]).get("kind", "all")
                    except (ValueError, AttributeError):
                        kind = "all"
                    await self.reload(kind if kind in ("keys", "routes") else "all")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("gateway: Redis subscription lost (%s); again in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _report_inflight_forever(self) -> None:
        assert self.redis is not None
        while True:
            try:
                counts = {rid: n for rid, n in self.inflight.items() if n > 0}
                await placement_inflight.report_async(self.redis, self.process_id, counts)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("gateway: could not report in-flight requests: %s", e)
            await asyncio.sleep(INFLIGHT_REPORT_S)

    async def _scrape_forever(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway: reading the engines' metrics failed")
            await asyncio.sleep(settings.LLMGW_GATEWAY_SCRAPE)

    async def _scrape(self, b: Backend) -> None:
        assert self.client is not None
        try:
            r = await self.client.get(b.endpoint + "/metrics", timeout=max(1.0, settings.LLMGW_GATEWAY_SCRAPE))
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            load = parse(r.text, names_for(b.engine, b.engine_version))
            if load is not None:
                self.engine[b.id] = (load, time.monotonic())

    async def scrape_once(self) -> None:
        """Read every routed replica's engine figures, and share them (with ejections) for the admin."""
        backends = {b.id: b for route in self.routes.values() for b in route.backends}
        await asyncio.gather(*(self._scrape(b) for b in backends.values()))
        for rid in set(self.engine) - set(backends):
            del self.engine[rid]
        if self.redis is not None:
            now = time.monotonic()
            rows = {}
            for rid in backends:
                load = self.engine.get(rid, (None, 0.0))[0]
                h = self.health.get(rid)
                rows[rid] = figures.Figures(
                    running=load.running if load else None,
                    waiting=load.waiting if load else None,
                    kv_usage=load.kv_usage if load else None,
                    hit_ratio=load.hit_ratio if load else None,
                    inflight=self.inflight.get(rid, 0),
                    ejected_for_s=round(h.ejected_until - now, 1) if h and h.ejected_until > now else 0.0,
                    failures=h.failures if h else 0,
                )
            await figures.publish_async(self.redis, rows)

    def loads(self, backends: tuple[Backend, ...]) -> dict[str, float]:
        """Each replica's load: this process's requests in flight, or the engine's own count when higher."""
        fresh = time.monotonic() - 3 * settings.LLMGW_GATEWAY_SCRAPE
        out: dict[str, float] = {}
        for b in backends:
            mine = self.inflight.get(b.id, 0)
            seen = self.engine.get(b.id)
            out[b.id] = max(mine, seen[0].load) if seen is not None and seen[1] >= fresh else mine
        return out

    async def _flush_usage_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(settings.LLMGW_GATEWAY_USAGE_FLUSH)
            await self._flush_usage(loop)

    async def _flush_usage(self, loop: asyncio.AbstractEventLoop) -> None:
        rows = self.usage.take()
        if not rows:
            return
        try:
            await loop.run_in_executor(self._db, usage.write_batch, rows)
        except Exception:
            log.exception("gateway: could not write usage; keeping it for the next flush")
            self.usage.put_back(rows)

    async def startup(self) -> None:
        """Open the pools, load the table, start the background loops."""
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500, keepalive_expiry=30),
            timeout=httpx.Timeout(settings.LLMGW_GATEWAY_UPSTREAM_TIMEOUT, connect=5.0),
        )
        if settings.REDIS_URL:
            self.redis = aioredis.Redis.from_url(settings.REDIS_URL)
            self.limiter.redis = self.redis
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
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await placement_inflight.report_async(self.redis, self.process_id, None)
            await self.redis.aclose()
        self._db.shutdown(wait=False)

    # ---- replica health --------------------------------------------------

    def _ejected(self, now: float) -> set[str]:
        return {rid for rid, h in self.health.items() if h.ejected_until > now}

    def _failed(self, backend: Backend) -> None:
        h = self.health[backend.id]
        h.failures += 1
        if h.failures >= settings.LLMGW_GATEWAY_EJECT_AFTER and h.ejected_until <= time.monotonic():
            h.ejected_until = time.monotonic() + settings.LLMGW_GATEWAY_EJECT_FOR
            self.metrics.ejected.labels(backend.id).set(1)
            log.warning("gateway: replica %s ejected after %d failures in a row", backend.id, h.failures)

    def _succeeded(self, backend: Backend) -> None:
        h = self.health.get(backend.id)
        if h is not None and h.failures:
            h.failures = 0
            if h.ejected_until:
                h.ejected_until = 0.0
                self.metrics.ejected.labels(backend.id).set(0)

    # ---- ASGI ------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await self._json(send, 200, {"status": "ok", "models": len(self.routes)})
            return
        if path == "/metrics" and method == "GET":
            await self._metrics(send)
            return
        key = self._authenticate(scope)
        if isinstance(key, bytes):
            await self._raw(send, 401, key)
            return
        if path == "/v1/models" and method == "GET":
            await self._models(send, key)
            return
        if path in PROXIED and method == "POST":
            await self._proxy(scope, receive, send, key, path)
            return
        await self._raw(send, 404, _error_body(404, f"no route {method} {path}", "invalid_request_error", "not_found"))

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
            return _error_body(
                401, "missing API key: send Authorization: Bearer <key>", "authentication_error", "missing_api_key"
            )
        entry = self.keys.get(gwkeys.hash_secret(token.strip()))
        if entry is None:
            return _error_body(401, "invalid or revoked API key", "authentication_error", "invalid_api_key")
        if entry.expired(dt.datetime.now(dt.UTC)):
            return _error_body(401, f"API key {entry.name!r} has expired", "authentication_error", "expired_api_key")
        return entry

    async def _raw(self, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Send, status: int, data: Any) -> None:
        await self._raw(send, status, json.dumps(data).encode())

    async def _metrics(self, send: Send) -> None:
        # Every routed replica, so one whose requests all finished reads 0, not its last count.
        routed = {b.id for route in self.routes.values() for b in route.backends}
        for rid in routed | set(self.inflight):
            self.metrics.inflight.labels(rid).set(self.inflight.get(rid, 0))
        now = time.monotonic()
        for rid, h in list(self.health.items()):
            self.metrics.ejected.labels(rid).set(1 if h.ejected_until > now else 0)
        body = generate_latest(self.metrics.registry)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _models(self, send: Send, key: KeyEntry) -> None:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "llmgw",
                "ready_replicas": len(route.backends),
                "replicas": route.desired,
            }
            for name, route in sorted(self.routes.items())
            if key.allows(name)
        ]
        await self._json(send, 200, {"object": "list", "data": data})

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
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

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, key: KeyEntry, path: str) -> None:
        started = time.monotonic()
        try:
            raw = await self._read_body(receive)
        except ClientGone:
            return
        if raw is None:
            await self._raw(
                send, 413, _error_body(413, f"body over {MAX_BODY} bytes", "invalid_request_error", "too_large")
            )
            return
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError):
            await self._raw(send, 400, _error_body(400, "body is not JSON", "invalid_request_error", "invalid_json"))
            return
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            await self._raw(
                send,
                400,
                _error_body(400, "model: required, a string", "invalid_request_error", "invalid_value", "model"),
            )
            return
        route = self.routes.get(model)
        if route is None:
            await self._raw(
                send,
                404,
                _error_body(
                    404, f"the model {model!r} does not exist", "invalid_request_error", "model_not_found", "model"
                ),
            )
            return
        if not key.allows(model):
            await self._raw(
                send,
                403,
                _error_body(
                    403, f"API key {key.name!r} may not use {model!r}", "permission_error", "model_not_allowed", "model"
                ),
            )
            return
        wall = time.time()
        retry_after = await self.limiter.admit(key, wall)
        if retry_after is not None:
            self.metrics.requests.labels(model, "429").inc()
            self.usage.add(key.id, model, wall, error=True)
            await self._raw(
                send,
                429,
                _error_body(
                    429,
                    f"API key {key.name!r} is over its limit for this minute",
                    "rate_limit_error",
                    "rate_limit_exceeded",
                ),
                [(b"retry-after", str(math.ceil(retry_after)).encode())],
            )
            return

        async def spend(o: Outcome) -> None:
            await self.limiter.spend(key, o.prompt_tokens + o.completion_tokens, time.time())

        out = await self._forward(receive, send, route, body, raw, path, started, spend)
        await out.settle_once()
        self.metrics.requests.labels(model, str(out.code)).inc()
        if out.prompt_tokens:
            self.metrics.tokens.labels(model, "prompt").inc(out.prompt_tokens)
        if out.completion_tokens:
            self.metrics.tokens.labels(model, "completion").inc(out.completion_tokens)
        if out.ttft is not None:
            self.metrics.ttft.labels(model).observe(out.ttft)
        self.metrics.duration.labels(model).observe(time.monotonic() - started)
        self.usage.add(
            key.id,
            model,
            wall,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            error=out.error,
            ttft=out.ttft,
        )

    async def _forward(
        self,
        receive: Receive,
        send: Send,
        route: ModelRoute,
        body: dict,
        raw: bytes,
        path: str,
        started: float,
        settle: Callable[[Outcome], Awaitable[None]] | None = None,
    ) -> Outcome:
        """Send the request to a replica, once more to another on a failure before the first byte, and relay."""
        assert self.client is not None
        stream = bool(body.get("stream"))
        if stream and path != "/v1/embeddings":
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                # The usage of a stream is counted from the engine's own last chunk.
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                raw = json.dumps(body).encode()
        rkey = routing.prefix_key(body)
        tried: set[str] = set()
        last = ""
        for attempt in range(2):
            now = time.monotonic()
            if self.round_robin:
                self.turn += 1
                backend = routing.round_robin(route.backends, self.turn, exclude=tried | self._ejected(now))
            else:
                backend = routing.choose(
                    route.backends, key=rkey, load=self.loads(route.backends), exclude=tried | self._ejected(now)
                )
            if backend is None:
                break
            tried.add(backend.id)
            self.inflight[backend.id] += 1
            try:
                request = self.client.build_request(
                    "POST",
                    backend.endpoint + path,
                    content=raw,
                    headers={"content-type": "application/json", "accept": "application/json, text/event-stream"},
                )
                try:
                    response = await self.client.send(request, stream=True)
                except httpx.TransportError as e:
                    self._failed(backend)
                    last = f"replica {backend.id[:8]}: {type(e).__name__}"
                    self.metrics.retries.inc(1 - attempt)
                    continue
                if response.status_code >= 500:
                    await response.aclose()
                    self._failed(backend)
                    last = f"replica {backend.id[:8]}: HTTP {response.status_code}"
                    self.metrics.retries.inc(1 - attempt)
                    continue
                self._succeeded(backend)
                return await self._relay(receive, send, response, backend, started, settle)
            finally:
                self.inflight[backend.id] -= 1
                if not self.inflight[backend.id]:
                    del self.inflight[backend.id]
        if not tried:
            retry = "5"
            message = route.unavailable_reason()
            if route.backends:
                message += f" ({len(route.backends)} ejected after repeated failures)"
            await self._raw(
                send,
                503,
                _error_body(503, message, "service_unavailable", "no_ready_replica"),
                [(b"retry-after", retry.encode())],
            )
            return Outcome(code=503, error=True)
        await self._raw(
            send,
            502,
            _error_body(502, f"{route.name}: upstream failed ({last})", "upstream_error", "upstream_failed"),
        )
        return Outcome(code=502, error=True)

    async def _relay(
        self,
        receive: Receive,
        send: Send,
        response: httpx.Response,
        backend: Backend,
        started: float,
        settle: Callable[[Outcome], Awaitable[None]] | None,
    ) -> Outcome:
        """Pass the replica's answer through as it arrives; stop at once when the client goes away."""
        out = Outcome(code=response.status_code, error=response.status_code >= 400, settle=settle)
        relay = asyncio.ensure_future(self._pump(send, response, backend, out, started))
        watch = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:
                relay.cancel()
                out.error = True
                out.code = 499
            with contextlib.suppress(asyncio.CancelledError, ClientGone):
                await relay
        finally:
            watch.cancel()
            # Closing the stream closes the upstream connection: the engine sees the client gone.
            await response.aclose()
        return out

    async def _wait_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _pump(self, send: Send, response: httpx.Response, backend: Backend, out: Outcome, started: float) -> None:
        headers = [(b"x-llmgw-replica", backend.id.encode())]
        ctype = response.headers.get("content-type", "application/json")
        headers.append((b"content-type", ctype.encode()))
        sse = ctype.startswith("text/event-stream")
        if sse:
            headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        tail = b""
        whole: list[bytes] = []
        async for chunk in response.aiter_raw():
            if out.ttft is None:
                out.ttft = time.monotonic() - started
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as e:
                raise ClientGone from e
            if sse:
                tail = self._scan_sse(tail + chunk, out)
            else:
                whole.append(chunk)
        if not sse and whole:
            with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError, TypeError):
                self._take_usage(json.loads(b"".join(whole)).get("usage"), out)
        await out.settle_once()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _scan_sse(self, buf: bytes, out: Outcome) -> bytes:
        """Read usage from complete `data:` lines; return the incomplete rest."""
        *lines, rest = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
                    self._take_usage(json.loads(line[6:]).get("usage"), out)
        return rest

    @staticmethod
    def _take_usage(u: Any, out: Outcome) -> None:
        if isinstance(u, dict):
            out.prompt_tokens = int(u.get("prompt_tokens") or 0)
            out.completion_tokens = int(u.get("completion_tokens") or 0)


def make_app() -> DataPlane:
    """A data plane for this process (DJANGO_SETTINGS_MODULE must be set up)."""
    log.info("gateway data plane %s starting (pid %d)", "llmgw", os.getpid())
    return DataPlane()
