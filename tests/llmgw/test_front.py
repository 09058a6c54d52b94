"""The web server's front (llmgw/front.py): a background request waits for every other one."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from llmgw.front import DEFAULT_URGENCY, Front, Lanes, urgency


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"u=7", 7),
        (b"u=0", 0),
        (b"u=5, i", 5),
        (b"i, u=6", 6),
        (b" u = 4 ", 4),
        (b"i", DEFAULT_URGENCY),
        (b"", DEFAULT_URGENCY),
        (b"u=8", DEFAULT_URGENCY),
        (b"u=-1", DEFAULT_URGENCY),
        (b"u=high", DEFAULT_URGENCY),
    ],
)
def test_the_urgency_is_read_as_rfc_9218_says_and_a_bad_one_is_the_default(value, expected):
    assert urgency(value) == expected


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
    assert front.lanes.free == 1


def test_a_waiter_that_leaves_gives_up_its_place_and_a_thread_handed_to_it_goes_on():
    async def go() -> tuple[int, list[str]]:
        lanes = Lanes(1)
        order: list[str] = []
        await lanes.enter(background=False)  # the one thread is taken

        async def one(name: str, *, background: bool) -> None:
            await lanes.enter(background=background)
            order.append(name)
            lanes.leave()

        gone = asyncio.ensure_future(one("gone", background=False))
        handed = asyncio.ensure_future(one("handed", background=False))
        later = asyncio.ensure_future(one("later", background=True))
        await asyncio.sleep(0)
        gone.cancel()  # a client that left while waiting
        await asyncio.sleep(0)
        lanes.leave()  # the thread goes to "handed", which is cancelled before it runs: it passes it on
        handed.cancel()
        await asyncio.gather(gone, handed, later, return_exceptions=True)
        return lanes.free, order

    assert asyncio.run(go()) == (1, ["later"])
