"""What a data plane reports per model for the autoscaler: held requests, recent TTFTs, the engines' queue."""

from __future__ import annotations

import time
from collections import deque

from gateway.dataplane.app import DataPlane
from gateway.table import Backend, ModelRoute
from llmgw_wire.engines import EngineLoad
from placement import demand


def backend(rid: str) -> Backend:
    return Backend(rid, f"http://127.0.0.1:1/{rid}", "echo", "", "chat")


def test_demand_sums_the_queue_of_fresh_scrapes_and_keeps_the_last_minute_of_ttfts():
    dp = DataPlane()
    dp.routes = {
        "chat": ModelRoute("chat", (backend("r1"), backend("r2"), backend("r3")), 3, "", hold=True),
        "idle": ModelRoute("idle", (), 0, "", hold=True),
    }
    now = time.monotonic()
    dp.engine = {
        "r1": (EngineLoad(running=4, waiting=3), now),
        "r2": (EngineLoad(running=4, waiting=2), now),
        "r3": (EngineLoad(running=4, waiting=50), now - 3600),  # a stale scrape says nothing
    }
    dp.saw_ttft("chat", 0.4)
    dp.saw_ttft("chat", 1.2)
    dp.ttfts["chat"].appendleft((now - demand.TTFT_WINDOW_S - 1, 9.0))  # older than the window
    dp.held["idle"] = 2
    assert dp.demand() == {
        "chat": demand.ModelDemand(held=0, ttft=(0.4, 1.2), waiting=5.0),
        "idle": demand.ModelDemand(held=2, ttft=(), waiting=None),
    }


def test_nothing_to_report_is_an_empty_report():
    dp = DataPlane()
    dp.routes = {"chat": ModelRoute("chat", (backend("r1"),), 1, "")}
    assert dp.demand() == {}
    dp.ttfts["chat"] = deque([(time.monotonic() - 3600, 0.5)])
    assert dp.demand() == {}
    assert "chat" not in dp.ttfts
