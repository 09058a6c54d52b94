"""GET /api/v1/agent/wait: who may wait, what wakes it, and that enqueuing a command does."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connections, transaction
from django.utils import timezone

import llmgw_wire as wire
from agents import credentials
from agents.wakeup import WAIT_PATH, DatabaseHub, Hub, WaitEndpoint, with_agent_wakeup
from inventory import outbox, wakeups
from tests.factories import make_node

pytestmark = pytest.mark.django_db(transaction=True)


async def _inner(scope, receive, send):
    """What the gateway's data plane would answer: everything that is not the wait."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b"gateway"})


def wait(token: str | None, node: str, *, hold_s: float = 0.3, publish: str | None = None, redis_url=None):
    """One GET of the wait endpoint (publishing `publish`'s channel while it waits); (status, json or None)."""
    endpoint = WaitEndpoint(hold_s=hold_s, redis_url=redis_url)
    app = with_agent_wakeup(_inner, endpoint=endpoint)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            request = asyncio.ensure_future(client.get(WAIT_PATH, params={"node": node}, headers=headers))
            if publish is not None:
                # Once this process is subscribed and the wait is registered.
                while endpoint.hub is None or not endpoint.hub.waiters.get(publish):
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(endpoint.hub.subscribed.wait(), 5)
                await asyncio.to_thread(wakeups.publish, publish)
            r = await request
            if endpoint.hub is not None:
                await endpoint.hub.close()
            return r.status_code, (r.json() if r.content else None)

    return asyncio.run(go())


@pytest.fixture
def nodes():
    now = timezone.now()
    make_node("gpu-a", now=now)
    make_node("gpu-b", now=now)
    return {n: credentials.issue(n, now=now, issued_by="test") for n in ("gpu-a", "gpu-b")}


def test_no_credential_is_refused(nodes):
    assert wait(None, "gpu-a")[0] == 401
    assert wait("not-a-credential", "gpu-a")[0] == 401
    assert wait(credentials.NODE_PREFIX + "made-up", "gpu-a")[0] == 401


def test_another_nodes_credential_is_refused(nodes):
    status, body = wait(nodes["gpu-b"], "gpu-a")
    assert status == 401 and "gpu-a" not in str(body)


def test_a_reset_credential_is_refused(nodes):
    assert credentials.reset("gpu-a", now=timezone.now())
    assert wait(nodes["gpu-a"], "gpu-a")[0] == 401


def test_own_credential_waits_then_answers_no_content(nodes):
    t0 = time.monotonic()
    assert wait(nodes["gpu-a"], "gpu-a", hold_s=0.3) == (204, None)
    assert time.monotonic() - t0 >= 0.3


def test_own_credential_is_woken_by_its_nodes_publish(nodes):
    assert wait(nodes["gpu-a"], "gpu-a", hold_s=20, publish="gpu-a") == (200, {"work": True})


def test_without_redis_the_wait_answers_when_the_outbox_holds_a_command_for_its_node(nodes):
    assert wait(nodes["gpu-a"], "gpu-a", redis_url="", hold_s=0.5) == (204, None)
    outbox.enqueue("gpu-a", wire.StopShard(shard_id="s-1"), now=timezone.now())
    assert wait(nodes["gpu-a"], "gpu-a", redis_url="", hold_s=20) == (200, {"work": True})
    assert wait(nodes["gpu-b"], "gpu-b", redis_url="", hold_s=0.5) == (204, None)


def _in_thread(fn, *args, **kw):
    """Run `fn` in a worker thread with a database connection of its own, closed after."""

    def call():
        try:
            return fn(*args, **kw)
        finally:
            connections.close_all()

    return asyncio.to_thread(call)


def test_the_database_hub_wakes_once_per_command_until_it_is_delivered(nodes):
    async def go():
        hub = DatabaseHub(executor=ThreadPoolExecutor(max_workers=1), poll_s=0.05)
        hub.start()
        try:
            await _in_thread(outbox.enqueue, "gpu-a", wire.StopShard(shard_id="s-1"), now=timezone.now())
            first = await hub.wait("gpu-a", 20)
            # The same command, not yet fetched by the heartbeat the wakeup asked for: no second wakeup.
            again = await hub.wait("gpu-a", 0.5)
            await _in_thread(outbox.enqueue, "gpu-a", wire.StopShard(shard_id="s-2"), now=timezone.now())
            second = await hub.wait("gpu-a", 20)
            # Both delivered by a heartbeat: nothing is waiting any more.
            await _in_thread(outbox.pending, "gpu-a", now=timezone.now())
            after = await hub.wait("gpu-a", 0.5)
            return first, again, second, after
        finally:
            await hub.close()

    assert asyncio.run(go()) == (True, False, True, False)


def test_other_paths_go_to_the_wrapped_application(nodes):
    async def go():
        transport = httpx.ASGITransport(app=with_agent_wakeup(_inner, endpoint=WaitEndpoint(hold_s=0.1)))
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            return (await client.get("/v1/models")).status_code

    assert asyncio.run(go()) == 299


def test_hub_wakes_only_the_node_published_and_remembers_a_missed_one(settings):
    async def go():
        hub = Hub(settings.REDIS_URL, wakeups.channel_prefix(), remember_s=5)
        a = asyncio.ensure_future(hub.wait("gpu-a", 5))
        b = asyncio.ensure_future(hub.wait("gpu-b", 0.3))
        await asyncio.sleep(0.05)
        assert hub.deliver("gpu-a") == 1
        # Published while gpu-c was between two polls: its next poll answers at once.
        assert hub.deliver("gpu-c") == 0
        c = await hub.wait("gpu-c", 5)
        return await a, await b, c, hub.waiters

    assert asyncio.run(go()) == (True, False, True, {})


def test_a_new_wait_for_the_same_node_ends_the_older(settings):
    async def go():
        hub = Hub(settings.REDIS_URL, wakeups.channel_prefix())
        old = asyncio.ensure_future(hub.wait("gpu-a", 5))
        await asyncio.sleep(0.05)
        new = asyncio.ensure_future(hub.wait("gpu-a", 0.2))
        t0 = time.monotonic()
        first = await old
        return first, time.monotonic() - t0 < 1, await new

    assert asyncio.run(go()) == (False, True, False)


def test_enqueuing_a_command_wakes_its_node_after_the_commit(settings):
    import redis

    make_node("gpu-c", now=timezone.now())
    client = redis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub()
    pubsub.subscribe(wakeups.channel("gpu-c"))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    try:
        with transaction.atomic():
            outbox.enqueue("gpu-c", wire.StopShard(shard_id="s-1"), now=timezone.now())
            assert pubsub.get_message(timeout=0.3) is None
        m = pubsub.get_message(timeout=2)
        assert m is not None and m["channel"].decode() == wakeups.channel("gpu-c")
    finally:
        pubsub.close()
        client.close()


def test_a_wait_is_routine_logged_at_debug_only(nodes, caplog):
    # Every node holds one at all times: nothing at INFO, one line at DEBUG.
    with caplog.at_level(logging.INFO):
        assert wait(nodes["gpu-a"], "gpu-a", hold_s=0.1) == (204, None)
    assert caplog.records == []
    with caplog.at_level(logging.DEBUG):
        assert wait(nodes["gpu-a"], "gpu-a", hold_s=0.1) == (204, None)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "agents.wakeup"] == [
        ("DEBUG", "agent wait: node gpu-a heard nothing")
    ]


def test_the_hold_is_the_setting(settings):
    settings.LLMGW_AGENT_WAIT_S = 7.5
    assert WaitEndpoint(redis_url="").hold_s == 7.5
