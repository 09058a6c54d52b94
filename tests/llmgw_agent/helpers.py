"""Helpers for the node agent's tests: free ports, polling until a condition holds, echo StartShards."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

import llmgw_wire as wire


def free_port() -> int:
    """A TCP port the OS says is free on loopback (bind port 0, read it back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], object], *, timeout: float = 10.0, step: float = 0.05):
    """Poll cond until it returns something truthy; fail the test after timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(step)
    pytest.fail(f"condition not met within {timeout}s")


def echo_start(shard_id: str = "s1", *, port: int | None = None, load: float = 0.3, args=(), **kw) -> wire.StartShard:
    """A StartShard for the echo engine on a free port."""
    profile = wire.EngineProfile(
        name="echo-test", engine="echo", served_model_name="demo", args=["--load-seconds", str(load), *args]
    )
    return wire.StartShard(
        id=kw.pop("id", f"cmd-{shard_id}"),
        replica_id=kw.pop("replica_id", "r1"),
        shard_id=shard_id,
        http_port=port or free_port(),
        profile=profile,
        **kw,
    )
