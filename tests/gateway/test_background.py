"""The data plane's background work (gateway/dataplane/background.py): the engines' figures, read without stalling."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aioredis

from gateway import notify
from gateway.dataplane import background
from gateway.dataplane.app import DataPlane
from tests.gateway.conftest import make_deployment

pytestmark = pytest.mark.django_db(transaction=True)


def _plane(handler) -> DataPlane:
    plane = DataPlane()
    plane.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return plane


def test_a_thousand_replicas_are_read_at_most_scrape_concurrency_at_a_time():
    # Every replica's /metrics at once queued a thousand requests in the HTTP client's pool, and the
    # event loop (the data plane's and the agents' leases') spent seconds assigning them.
    make_deployment("big", [f"http://127.0.0.1:9/r{i}" for i in range(100)])
    limit = background.SCRAPE_CONCURRENCY
    inflight, peak, asked = [0], [0], []
    release = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        asked.append(request.url.path)
        if inflight[0] == limit:
            release.set()
        # (Bounded: with no limit at all the test fails on the peak rather than hang.)
        await asyncio.wait_for(release.wait(), 10)
        inflight[0] -= 1
        return httpx.Response(200, text="")

    async def go() -> DataPlane:
        plane = _plane(handler)
        try:
            await plane.reload("all")
            await plane.scrape_once()
        finally:
            await plane.client.aclose()
        return plane

    asyncio.run(go())
    assert peak[0] == limit
    assert sorted(asked) == sorted(f"/r{i}/metrics" for i in range(100))


def test_a_replica_that_does_not_answer_is_asked_again_after_a_doubling_backoff(settings):
    settings.LLMGW_GATEWAY_SCRAPE = 1.0
    _up, down = make_deployment("m", ["http://127.0.0.1:9/up", "http://127.0.0.1:9/down"])
    answering = {"/up/metrics": True, "/down/metrics": False}
    asked: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path.split("/")[1])
        if not answering[request.url.path]:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, text="")

    async def go() -> list[tuple[float, list[str], tuple[int, float] | None]]:
        plane = _plane(handler)
        seen = []
        try:
            await plane.reload("all")
            for now in (1000.0, 1000.5, 1001.0, 1002.0, 1003.0, 1004.0):
                if now == 1003.0:
                    answering["/down/metrics"] = True
                asked.clear()
                await plane.scrape_once(now=now)
                seen.append((now, sorted(asked), plane.scrape_failures.get(str(down.id))))
        finally:
            await plane.client.aclose()
        return seen

    assert asyncio.run(go()) == [
        # Failed once: asked again one interval later.
        (1000.0, ["down", "up"], (1, 1001.0)),
        (1000.5, ["up"], (1, 1001.0)),
        # Failed twice in a row: two intervals.
        (1001.0, ["down", "up"], (2, 1003.0)),
        (1002.0, ["up"], (2, 1003.0)),
        # It answers: forgotten, asked every interval again.
        (1003.0, ["down", "up"], None),
        (1004.0, ["down", "up"], None),
    ]


def test_the_backoff_is_capped_and_forgotten_with_the_replica(settings):
    settings.LLMGW_GATEWAY_SCRAPE = 2.0
    (gone,) = make_deployment("m", ["http://127.0.0.1:9/gone"])

    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> tuple[tuple[int, float], dict]:
        plane = _plane(handler)
        try:
            await plane.reload("all")
            now = 0.0
            for _ in range(9):
                await plane.scrape_once(now=now)
                now = plane.scrape_failures[str(gone.id)][1]
            capped = plane.scrape_failures[str(gone.id)]
            # The replica leaves the table: its backoff goes with it.
            plane.routes = {}
            await plane.scrape_once(now=now)
            return capped, plane.scrape_failures
        finally:
            await plane.client.aclose()

    capped, left = asyncio.run(go())
    # 1, 2, 4, 8, 16, then 30 intervals (the cap) of 2 s: the ninth failure's next try is 60 s later.
    waits = [min(background.SCRAPE_BACKOFF_MAX, 2**k) * 2.0 for k in range(9)]
    assert capped == (9, sum(waits))
    assert waits[-1] == 60.0
    assert left == {}


def test_a_burst_of_route_changes_is_one_reload_and_a_key_is_reloaded_at_once(settings):
    # A thousand replicas starting together send a message each: one reload of the table per message
    # kept the gateway's process busy with nothing else. A key, though, is used the moment it is made.
    if not settings.REDIS_URL:
        pytest.skip("change messages travel through Redis")
    make_deployment("m", ["http://127.0.0.1:9/a"])

    async def go() -> tuple[list[str], list[str]]:
        plane = DataPlane()
        plane.redis = aioredis.Redis.from_url(settings.REDIS_URL)
        pubsub = plane.redis.pubsub()
        reloads: list[str] = []
        load = plane.reload

        async def counted(kind: str = "all") -> None:
            reloads.append(kind)
            await load(kind)

        plane.reload = counted
        try:
            await pubsub.subscribe(notify.channel())
            await pubsub.get_message(timeout=5)  # the subscription's own confirmation
            # The routes' reload held (as if one had just begun) until every message was read.
            plane.reloaded_at = time.monotonic() + 3600
            for _ in range(50):
                notify.publish("routes")
            notify.publish("keys")
            read = []
            while len(read) < 51:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
                assert message is not None, read
                read.append(background._kind(message))
                await plane.on_change(read[-1])
            # The key was reloaded as its message was read; the fifty route changes wait for one reload.
            before = list(reloads)
            waiting = plane.routes_task
            plane.reloaded_at = 0.0
            await waiting
            assert plane.routes_task is waiting
        finally:
            await pubsub.aclose()
            await plane.redis.aclose()
        return before, reloads

    before, after = asyncio.run(go())
    assert before == ["keys"]
    assert after == ["keys", "routes"]


def test_a_route_change_during_a_reload_asks_for_one_more():
    # The reload in progress may have read the tables before that change was committed.
    make_deployment("m", ["http://127.0.0.1:9/a"])

    async def go() -> list[str]:
        plane = DataPlane()
        reloads: list[str] = []
        reading = asyncio.Event()
        go_on = asyncio.Event()
        load = plane.reload

        async def held(kind: str = "all") -> None:
            reloads.append(kind)
            if len(reloads) == 1:
                reading.set()
                await go_on.wait()
            await load(kind)

        plane.reload = held
        await plane.on_change("routes")
        await reading.wait()
        # A second change while the first reload reads: the same task reloads once more.
        first = plane.routes_task
        await plane.on_change("routes")
        await plane.on_change("routes")
        assert plane.routes_task is first
        go_on.set()
        await first
        return reloads

    assert asyncio.run(go()) == ["routes", "routes"]


@pytest.mark.parametrize(
    ("data", "kind"),
    [(b'{"kind": "routes"}', "routes"), (b'{"kind": "keys"}', "keys"), (b'{"kind": "x"}', "all"), (b"no", "all")],
)
def test_a_change_message_names_what_to_reload(data, kind):
    assert background._kind({"type": "message", "data": data}) == kind
