"""Ports for servers the tests start, chosen so nothing else takes them in the meantime."""

from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768 and up): a port the test reserves ahead of time
# there was taken at any moment by an outgoing connection (the test's own HTTP
# clients, PostgreSQL, Redis), and a shard placed on it exited with "address in use".
LOW, HIGH = 20000, 32000


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count: int = 16) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 now, outside the ephemeral range."""
    pick = random.SystemRandom()
    for _ in range(500):
        base = pick.randrange(LOW, HIGH - count)
        if all(_free(p) for p in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports between {LOW} and {HIGH}")
