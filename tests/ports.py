"""Ports for servers the tests start, chosen so nothing else takes them in the meantime."""

from __future__ import annotations

import os
import random
import socket

# Below Linux's ephemeral range (32768 and up): a port the test reserves ahead of time
# there was taken at any moment by an outgoing connection (the test's own HTTP
# clients, PostgreSQL, Redis), and a shard placed on it exited with "address in use".
LOW, HIGH = 20000, 32000


def worker_span() -> tuple[int, int]:
    """This test process's share of [LOW, HIGH): under `pytest -n N` worker gwK takes the K-th of N slices.

    Free now is not free in a second: two workers reserving ranges at once
    could both find the same ports free, and the second to bind loses. Slices
    of their own never overlap, whatever the timing.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return LOW, HIGH
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    width = (HIGH - LOW) // count
    low = LOW + int(worker.removeprefix("gw")) * width
    return low, low + width


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count: int = 16) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 now, in this worker's slice of the low range."""
    low, high = worker_span()
    pick = random.SystemRandom()
    for _ in range(500):
        base = pick.randrange(low, high - count)
        if all(_free(p) for p in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")
