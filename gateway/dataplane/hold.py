"""Holding a request for a model at zero replicas while one starts, and telling the control plane of the demand.

An autoscaled model may have no replica ready (scaled to zero when idle,
or its first replica still starting). Its requests are then held, at most
LLMGW_GATEWAY_HOLD_QUEUE per model, each for at most
LLMGW_GATEWAY_HOLD_TIMEOUT: answered as soon as a replica is routed, or
with a 503 and Retry-After saying why (the deadline passed, the queue is
full, or the planner cannot place the model). The held count reaches the
reconciler with every in-flight report (placement/demand.py), and the first
held request queues a reconcile pass, so a replica is placed within a
pass rather than at the next periodic one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings

from gateway.dataplane.metrics import Metrics
from gateway.table import ModelRoute
from llmgw_wire.engines import EngineLoad
from placement import demand, queueing

log = logging.getLogger("gateway.dataplane")


class Holder:
    """The data plane's held requests and recent TTFTs per model (state is the DataPlane's)."""

    routes: dict[str, ModelRoute]
    held: dict[str, int]
    ttfts: dict[str, deque[tuple[float, float]]]
    route_changed: asyncio.Event
    engine: dict[str, tuple[EngineLoad, float]]
    inflight: dict[str, int]
    metrics: Metrics
    _db: ThreadPoolExecutor
    _report_inflight: Callable[[dict[str, int] | None], Awaitable[None]]

    def routes_reloaded(self) -> None:
        """Wake every held request: the table changed (a replica may be ready, or refused)."""
        self.route_changed.set()
        self.route_changed = asyncio.Event()

    def saw_ttft(self, model: str, ttft: float) -> None:
        """Keep a request's time to first token for the autoscaler's TTFT p95."""
        q = self.ttfts.setdefault(model, deque(maxlen=demand.TTFT_SAMPLES))
        q.append((time.monotonic(), ttft))

    def demand(self) -> dict[str, demand.ModelDemand]:
        """What this process reports per model: held requests, recent TTFTs, the engines' queue."""
        cutoff = time.monotonic() - demand.TTFT_WINDOW_S
        out: dict[str, demand.ModelDemand] = {}
        waiting: dict[str, float] = defaultdict(float)
        seen: set[str] = set()
        fresh = time.monotonic() - 3 * settings.LLMGW_GATEWAY_SCRAPE
        for name, route in self.routes.items():
            for b in route.backends:
                load = self.engine.get(b.id)
                if load is not None and load[1] >= fresh and load[0].waiting is not None:
                    waiting[name] += load[0].waiting
                    seen.add(name)
        for name in set(self.held) | set(self.ttfts) | seen:
            q = self.ttfts.get(name)
            recent = tuple(t for at, t in q if at >= cutoff) if q else ()
            if q is not None and not recent:
                del self.ttfts[name]
            held = self.held.get(name, 0)
            if held or recent or name in seen:
                out[name] = demand.ModelDemand(held, recent, waiting[name] if name in seen else None)
        return out

    async def _ask_for_a_replica(self, model: str) -> None:
        """Report the demand now and queue a reconcile pass (never fails the request)."""
        try:
            await self._report_inflight({rid: n for rid, n in self.inflight.items() if n > 0})
            await asyncio.get_running_loop().run_in_executor(
                self._db,
                queueing.ask_now,
                f"a request for {model} held at zero replicas",
            )
        except Exception as e:
            log.warning("gateway: could not ask for a replica of %s: %s", model, e)

    async def hold(self, route: ModelRoute) -> tuple[ModelRoute | None, str]:
        """Wait for a ready replica of `route`'s model: (the route with one, "") or (None, why not)."""
        name = route.name
        limit, timeout = settings.LLMGW_GATEWAY_HOLD_QUEUE, settings.LLMGW_GATEWAY_HOLD_TIMEOUT
        if self.held.get(name, 0) >= limit:
            return None, f"{name}: {limit} requests already wait for a replica to start"
        self.held[name] = self.held.get(name, 0) + 1
        self.metrics.held.labels(name).inc()
        if self.held[name] == 1:
            asyncio.get_running_loop().create_task(self._ask_for_a_replica(name))
        deadline = time.monotonic() + timeout
        try:
            while True:
                # Taken before looking, so a reload between the look and the wait still wakes it.
                changed = self.route_changed
                current = self.routes.get(name)
                if current is None:
                    return None, f"{name}: no longer deployed"
                if current.backends:
                    return current, ""
                if current.unplaceable:
                    return None, f"{name}: no replica can be placed: {current.unplaceable[:300]}"
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, f"no replica ready within {timeout:g} s; {current.unavailable_reason()}"
                # Woken by a reload; the second's timeout only re-reads the deadline.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 1.0))
        finally:
            self.held[name] -= 1
            if not self.held[name]:
                del self.held[name]
            self.metrics.held.labels(name).dec()
