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

from gateway import figures, notify, usage
from gateway.dataplane.upstream import Health
from gateway.table import Backend, KeyEntry, ModelRoute, load_keys, load_routes
from llmgw_wire.engines import EngineLoad, engine_load
from placement import demand as placement_demand
from placement import inflight as placement_inflight

log = logging.getLogger("gateway.dataplane")

# How often this process tells the reconciler its in-flight requests per replica.
INFLIGHT_REPORT_S = 0.5


class Background:
    """The data plane's loops. Its state (table, figures, usage) is the DataPlane's."""

    routes: dict[str, ModelRoute]
    keys: dict[str, KeyEntry]
    inflight: dict[str, int]
    health: dict[str, Health]
    engine: dict[str, tuple[EngineLoad, float]]
    process_id: str
    client: httpx.AsyncClient | None
    redis: aioredis.Redis | None
    usage: usage.Accumulator
    loaded: asyncio.Event
    # Holder's (gateway/dataplane/hold.py): wake held requests after a reload; this process's demand per model.
    routes_reloaded: Callable[[], None]
    demand: Callable[[], dict[str, placement_demand.ModelDemand]]
    _db: ThreadPoolExecutor

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

    async def _report_inflight(self, counts: dict[str, int] | None) -> None:
        """Tell the reconciler this process's requests in flight and demand per model (None: withdraw both).

        Through Redis, or files without it.
        """
        wanted = None if counts is None else self.demand()
        if self.redis is not None:
            await placement_inflight.report_async(self.redis, self.process_id, counts)
            await placement_demand.report_async(self.redis, self.process_id, wanted)
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

    async def _scrape(self, b: Backend) -> None:
        assert self.client is not None
        try:
            r = await self.client.get(b.endpoint + "/metrics", timeout=max(1.0, settings.LLMGW_GATEWAY_SCRAPE))
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            load = engine_load(b.engine, b.engine_version, r.text)
            if load is not None:
                self.engine[b.id] = (load, time.monotonic())

    async def scrape_once(self) -> None:
        """Read every routed replica's engine figures, and share them (with ejections) for the admin."""
        backends = {b.id: b for route in self.routes.values() for b in route.backends}
        await asyncio.gather(*(self._scrape(b) for b in backends.values()))
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
