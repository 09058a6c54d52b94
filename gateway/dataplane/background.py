"""What the data plane keeps current beside requests: the table, engines' figures, usage, in-flight reports."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections

from gateway import figures, notify, routing, usage
from gateway.dataplane.limits import Shared
from gateway.dataplane.upstream import Health
from gateway.table import Backend, KeyEntry, ModelRoute, load_keys, load_routes
from llmgw_wire.engines import EngineLoad, engine_load
from placement import demand as placement_demand
from placement import inflight as placement_inflight

log = logging.getLogger("gateway.dataplane")

# How often this process tells the reconciler its in-flight requests per replica.
INFLIGHT_REPORT_S = 0.5
# Engines' /metrics read at once, at most. The scrapes share the event loop with every request (and
# the agents' leases): a thousand replicas asked together queued in the HTTP client's pool, which scans
# its whole queue for each request it assigns, and the loop spent seconds doing nothing else; the
# fleet's leases waited behind it and the control plane read a mass silence.
SCRAPE_CONCURRENCY = 32
# A replica whose /metrics did not answer is asked again after this many scrape intervals, doubled per
# failure in a row (at most SCRAPE_BACKOFF_MAX of them): an unreachable one must not cost a timeout
# every second, and its figures are stale by then anyway (the in-flight count stands in).
SCRAPE_BACKOFF_MAX = 30


# Between two reloads of the routes pushed by change messages (see on_change): nine times what the last
# one took (reloads then take at most a tenth of the process), never more than RELOAD_SPACING_S.
RELOAD_SPACING_S = 0.25
RELOAD_SHARE = 0.1
# Tables of fewer replicas than this are reloaded at once, every time: they cost little, and a replica
# retired or added is routed accordingly the moment it is known.
SPACED_FROM = 100


def _kind(message: dict) -> str:
    """What a change message says changed: "keys", "routes", or "all" for anything else."""
    try:
        kind = json.loads(message["data"]).get("kind", "all")
    except (ValueError, AttributeError, KeyError, TypeError):
        return "all"
    return kind if kind in ("keys", "routes") else "all"


class Background:
    """The data plane's loops. Its state (table, figures, usage) is the DataPlane's."""

    routes: dict[str, ModelRoute]
    keys: dict[str, KeyEntry]
    inflight: dict[str, int]
    health: dict[str, Health]
    engine: dict[str, tuple[EngineLoad, float]]
    # When (monotonic) the last reload of the routes pushed by a change message began; the one waiting.
    reloaded_at: float
    reload_took: float
    # A change message came that the routes' next reload must read.
    routes_dirty: bool
    routes_task: asyncio.Task | None
    # Replicas whose /metrics did not answer: (failures in a row, monotonic time of the next try).
    scrape_failures: dict[str, tuple[int, float]]
    process_id: str
    client: httpx.AsyncClient | None
    redis: aioredis.Redis | None
    shared: Shared
    usage: usage.Accumulator
    loaded: asyncio.Event
    # Holder's (gateway/dataplane/hold.py): wake held requests after a reload; this process's demand per model.
    routes_reloaded: Callable[[], None]
    demand: Callable[[], dict[str, placement_demand.ModelDemand]]
    _db: ThreadPoolExecutor
    prefixes: routing.PrefixIndex

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
            self.prefixes.retain(b.id for r in routes.values() for b in r.backends)
            self.routes_reloaded()
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
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is not None:
                        await self.on_change(_kind(message))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("gateway: Redis subscription lost (%s); again in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def on_change(self, kind: str) -> None:
        """Act on one change message: keys (or everything) reloaded at once, the routes' changes together.

        A thousand replicas starting together send a message each, and a
        reload of a thousand-replica table (about 20 ms of CPU) per message
        kept the gateway's process busy with nothing else, its event loop and
        the agents' leases waiting behind it: the routes are reloaded once for
        every message that came within the spacing (from SPACED_FROM routed
        replicas on, nine times what the last reload took, at most
        RELOAD_SPACING_S; a replica is routed at most that much later; a
        smaller table at once). A key is used the
        moment it is made, and the keys' table is small: its messages are
        never held back.
        """
        if kind != "routes":
            await self.reload(kind)
            return
        self.routes_dirty = True
        if self.routes_task is None or self.routes_task.done():
            self.routes_task = asyncio.create_task(self._reload_routes_soon())

    async def _reload_routes_soon(self) -> None:
        # Messages that come while this waits ask for nothing more: the reload reads them all. One that
        # comes while the reload reads may name a change it read too early: it asks for one more.
        while self.routes_dirty:
            # The spacing is read again at each step, so that a test may hold the reload and let it go.
            routed = sum(len(r.backends) for r in self.routes.values())
            spacing = min(RELOAD_SPACING_S, self.reload_took * (1 / RELOAD_SHARE - 1)) if routed >= SPACED_FROM else 0.0
            while (wait := self.reloaded_at + spacing - time.monotonic()) > 0:
                await asyncio.sleep(min(wait, RELOAD_SPACING_S))
            self.routes_dirty = False
            self.reloaded_at = started = time.monotonic()
            try:
                await self.reload("routes")
            except Exception:
                log.exception("gateway: reloading the routes failed; the periodic refresh will retry")
            self.reload_took = time.monotonic() - started

    async def _report_inflight(self, counts: dict[str, int] | None) -> None:
        """Tell the reconciler this process's requests in flight and demand per model (None: withdraw both).

        Through Redis, or files without it. Redis down: the reconciler reads "unknown" and waits out the
        drain timeout; nothing is logged every half second (limits.Shared logs the change once).
        """
        wanted = None if counts is None else self.demand()
        if self.shared.redis is not None:
            await self.shared.call("inflight", lambda r: placement_inflight.report_async(r, self.process_id, counts))
            await self.shared.call("inflight", lambda r: placement_demand.report_async(r, self.process_id, wanted))
        else:
            await asyncio.to_thread(placement_inflight.report_file, self.process_id, counts)
            await asyncio.to_thread(placement_demand.report_file, self.process_id, wanted)

    async def _report_inflight_forever(self) -> None:
        while True:
            try:
                counts = {rid: n for rid, n in self.inflight.items() if n > 0}
                await self._report_inflight(counts)
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

    async def _scrape(self, b: Backend, slots: asyncio.Semaphore, now: float) -> None:
        assert self.client is not None
        async with slots:
            try:
                r = await self.client.get(b.endpoint + "/metrics", timeout=max(1.0, settings.LLMGW_GATEWAY_SCRAPE))
            except httpx.HTTPError:
                r = None
        if r is not None and r.status_code == 200:
            self.scrape_failures.pop(b.id, None)
            load = engine_load(b.engine, b.engine_version, r.text)
            if load is not None:
                self.engine[b.id] = (load, time.monotonic())
            return
        failures = self.scrape_failures.get(b.id, (0, 0.0))[0] + 1
        wait = min(SCRAPE_BACKOFF_MAX, 2 ** (failures - 1)) * settings.LLMGW_GATEWAY_SCRAPE
        self.scrape_failures[b.id] = (failures, now + wait)

    def scrape_due(self, backends: dict[str, Backend], *, now: float) -> list[Backend]:
        """The replicas to read now: every routed one, less those still backing off after failed reads."""
        for rid in set(self.scrape_failures) - set(backends):
            del self.scrape_failures[rid]
        return [b for rid, b in backends.items() if self.scrape_failures.get(rid, (0, 0.0))[1] <= now]

    async def scrape_once(self, *, now: float | None = None) -> None:
        """Read the routed replicas' engine figures (SCRAPE_CONCURRENCY at a time), and share them for the admin.

        A replica whose last reads failed waits out its backoff (scrape_due).
        `now` is the monotonic clock's, for tests to control the backoff.
        """
        now = time.monotonic() if now is None else now
        backends = {b.id: b for route in self.routes.values() for b in route.backends}
        slots = asyncio.Semaphore(SCRAPE_CONCURRENCY)
        await asyncio.gather(*(self._scrape(b, slots, now) for b in self.scrape_due(backends, now=now)))
        for rid in set(self.engine) - set(backends):
            del self.engine[rid]
        if backends:
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
            if self.redis is not None:
                await figures.publish_async(self.redis, rows)
            else:
                await asyncio.to_thread(figures.publish_cache, rows)

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
