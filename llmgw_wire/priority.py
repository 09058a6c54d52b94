"""Routine requests after the others: what an agent's routine status says, and the order a server keeps.

An agent sends its whole status at least once a minute (the floor,
llmgw_agent/status.py) even when nothing changed; a fleet that joined
within a minute sends those floors within the same minute of every minute,
and a status reporting a shard ready queued behind thousands of them was
heard seconds late. So a status sent only for the floor says it is routine
with RFC 9218's Priority header at the least urgency (ROUTINE), and a server
that reads it (the web server's front, llmgw/front.py) serves every other
waiting request first (Lanes). Leases keep the node alive while its routine
status waits (llmgw_agent/keepalive.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

# What a routine request carries: RFC 9218's least urgency.
ROUTINE = {"Priority": "u=7"}
# RFC 9218's default urgency (0 most urgent, 7 least); a request asking for more than this is routine.
DEFAULT_URGENCY = 3

T = TypeVar("T")


def urgency(value: bytes) -> int:
    """The urgency an RFC 9218 Priority header's value asks for (0-7); the default when it names none or a bad one."""
    for member in value.split(b","):
        key, _, given = member.strip().partition(b"=")
        if key.strip() == b"u":
            given = given.strip()
            return int(given) if given.isdigit() and int(given) <= 7 else DEFAULT_URGENCY
    return DEFAULT_URGENCY


class Lanes(Generic[T]):
    """A few things handed out on one event loop (threads, connections): every waiter before a routine one.

    Within each lane, first come first served. A thing given back goes
    straight to the next waiter, so none is taken by a newcomer past those
    already waiting.
    """

    def __init__(self, things: Iterable[T] = ()) -> None:
        self.free: deque[T] = deque(things)
        # (the default lane, the routine lane): the waiters, each woken with a thing.
        self.waiting: tuple[deque[asyncio.Future[T]], deque[asyncio.Future[T]]] = (deque(), deque())

    def empty(self) -> bool:
        """None free, or some waiting: a taker waits."""
        return not self.free or bool(self.waiting[0] or self.waiting[1])

    def get_nowait(self) -> T:
        """A free thing (IndexError when none is); for when empty() said one is."""
        return self.free.popleft()

    def put_nowait(self, thing: T) -> None:
        """Give a thing back: to the first waiter of the default lane, else of the routine one, else free."""
        for lane in self.waiting:
            while lane:
                waiter = lane.popleft()
                if not waiter.done():
                    waiter.set_result(thing)
                    return
        self.free.append(thing)

    async def get(self, *, routine: bool = False) -> T:
        """Take a thing, waiting behind those before in its lane (and, when routine, all of the other)."""
        if not self.empty():
            return self.free.popleft()
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.waiting[routine].append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put_nowait(waiter.result())  # handed one just as it left: it goes to the next
            raise
