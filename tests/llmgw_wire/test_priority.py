"""Routine requests after the others (llmgw_wire/priority.py): the header read, and the order kept."""

from __future__ import annotations

import asyncio

import pytest

from llmgw_wire.priority import DEFAULT_URGENCY, ROUTINE, Lanes, urgency


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


def test_a_routine_request_says_an_urgency_a_server_puts_last():
    (name, value), *_ = ROUTINE.items()
    assert (name, urgency(value.encode()) > DEFAULT_URGENCY) == ("Priority", True)


def test_a_thing_given_back_goes_to_a_waiter_that_is_not_routine_first_and_in_order_within_a_lane():
    async def main() -> tuple[list[str], int]:
        lanes: Lanes[str] = Lanes(["one"])
        assert not lanes.empty() and await lanes.get() == "one"  # free: at once
        order: list[str] = []

        async def wait(name: str, *, routine: bool) -> None:
            thing = await lanes.get(routine=routine)
            order.append(name)
            lanes.put_nowait(thing)

        tasks = [
            asyncio.ensure_future(wait(name, routine=routine))
            for name, routine in (("floor-1", True), ("ready-1", False), ("gone", False), ("floor-2", True))
        ]
        tasks.append(asyncio.ensure_future(wait("ready-2", routine=False)))
        await asyncio.sleep(0)
        assert lanes.empty()
        tasks[2].cancel()  # a waiter that left
        lanes.put_nowait("one")
        await asyncio.gather(*tasks, return_exceptions=True)
        return order, len(lanes.free)

    assert asyncio.run(main()) == (["ready-1", "ready-2", "floor-1", "floor-2"], 1)


def test_a_thing_handed_to_a_waiter_cancelled_before_it_ran_goes_on_to_the_next():
    async def main() -> tuple[list[str], int]:
        lanes: Lanes[str] = Lanes(["one"])
        taken = await lanes.get()
        order: list[str] = []

        async def wait(name: str, *, routine: bool) -> None:
            thing = await lanes.get(routine=routine)
            order.append(name)
            lanes.put_nowait(thing)

        handed = asyncio.ensure_future(wait("handed", routine=False))
        later = asyncio.ensure_future(wait("later", routine=True))
        await asyncio.sleep(0)
        lanes.put_nowait(taken)  # to "handed", which is cancelled before it runs: it passes it on
        handed.cancel()
        await asyncio.gather(handed, later, return_exceptions=True)
        return order, len(lanes.free)

    assert asyncio.run(main()) == (["later"], 1)
