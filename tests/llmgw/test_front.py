"""The web server's front (llmgw/front.py): a background request waits for every other one."""

from __future__ import annotations

import asyncio
import threading

import httpx

from llmgw.front import Front


class Held:
    """A WSGI application whose requests wait for the test to let each one go, in an order it records."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.started: list[str] = []
        self.released: set[str] = set()

    def __call__(self, environ, start_response):
        name = environ["PATH_INFO"].strip("/")
        with self.cond:
            self.started.append(name)
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: name in self.released, timeout=10), f"{name} never let go"
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [name.encode()]

    def release(self, name: str) -> None:
        with self.cond:
            self.released.add(name)
            self.cond.notify_all()

    def wait_started(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, timeout=10), self.started


def test_a_free_thread_takes_every_waiting_request_before_a_background_one():
    app = Held()
    front = Front(app, threads=1, body_timeout=5)

    async def go() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://web") as client:
            first = asyncio.ensure_future(client.post("/first", content=b"{}"))
            await asyncio.to_thread(app.wait_started, 1)
            # The one thread is busy: a routine status, then a status that reports a change, then another
            # routine one (RFC 9218's least urgency), then an operator's page (no Priority: the default).
            waiting = []
            for name, headers in (
                ("floor-1", {"Priority": "u=7"}),
                ("changed", {}),
                ("floor-2", {"Priority": "u=7"}),
                ("page", {"Priority": "u=3"}),
            ):
                waiting.append(asyncio.ensure_future(client.post(f"/{name}", content=b"{}", headers=headers)))
                while len(front.lanes.waiting[0]) + len(front.lanes.waiting[1]) < len(waiting):
                    await asyncio.sleep(0.005)
            for name in ("first", "changed", "page", "floor-1", "floor-2"):
                app.release(name)
            answers = await asyncio.gather(first, *waiting)
            assert [a.status_code for a in answers] == [200] * 5
            return list(app.started)

    assert asyncio.run(go()) == ["first", "changed", "page", "floor-1", "floor-2"]
    assert len(front.lanes.free) == 1


def test_the_front_stamps_when_it_had_the_whole_request_before_it_waited_for_a_thread():
    import time

    from llmgw.front import RECEIVED_AT

    app = Held()
    seen: dict = {}

    def record(environ, start_response):
        seen[environ["PATH_INFO"]] = (environ[RECEIVED_AT], time.time())
        return app(environ, start_response)

    front = Front(record, threads=1, body_timeout=5)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://web") as client:
            first = asyncio.ensure_future(client.post("/first", content=b"{}"))
            await asyncio.to_thread(app.wait_started, 1)
            second = asyncio.ensure_future(client.post("/second", content=b"{}"))
            while not front.lanes.waiting[0]:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # the second waits for the one thread
            app.release("first")
            app.release("second")
            await asyncio.gather(first, second)

    asyncio.run(go())
    received, handled = seen["/second"]
    assert handled - received >= 0.2
