"""Redis is the gateway's accelerator, not its dependency: a real Redis process, stopped under a real gateway.

Limits and budgets fall back to this process's own counting (said in the log
and in /metrics), the table still follows the database by its periodic
refresh, and when Redis answers again the counters are shared again. And
whatever fails inside the gateway, the client gets OpenAI's error shape and
the answer is counted.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.gateway.conftest import chat, free_port, make_deployment, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


class RedisServer:
    """A redis-server of the test's own, on a port of its own, with nothing persisted."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def pings(self) -> bool:
        with contextlib.suppress(redis.RedisError), redis.Redis(port=self.port, socket_timeout=1) as r:
            return bool(r.ping())
        return False

    def start(self) -> None:
        """Start it and wait until it answers."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        wait_for(self.pings, timeout=10, what="redis-server answering")

    def stop(self) -> None:
        """Kill it (no goodbye to its clients) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def _metric(text: str, line: str) -> float | None:
    """The value of the sample named `line` (name and labels as exposed), None when absent."""
    m = re.search(rf"^{re.escape(line)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_limits_count_in_this_process_while_redis_is_gone_and_are_shared_again_after(
    gateway_factory, own_redis, echoes, user
):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user, name="limited", rpm_limit=2)
    g = gateway_factory("redis-outage", refresh_s=1.0, extra_env={"REDIS_URL": own_redis.url})
    g.wait_ready(key, "demo", 1)
    # The requests below inside one minute.
    wait_for(lambda: time.time() % 60 < 30, timeout=35, what="room left in this minute")

    def remaining(r: httpx.Response) -> tuple[int, str]:
        return r.status_code, r.headers.get("x-ratelimit-remaining-requests", "")

    with g.client(key) as c:
        assert remaining(c.post("/v1/chat/completions", json=chat("a b"))) == (200, "1")
        assert _metric(g.metrics(), "llmgw_gateway_counters_local") == 0.0
        own_redis.stop()
        # This process counts the minute from zero on its own: two more, then its 429, never a 500.
        seen = [c.post("/v1/chat/completions", json=chat("a b")) for _ in range(3)]
    assert [remaining(r) for r in seen] == [(200, "1"), (200, "0"), (429, "0")]
    assert seen[2].json()["error"]["code"] == "rate_limit_exceeded"
    text = g.metrics()
    assert _metric(text, "llmgw_gateway_counters_local") == 1.0
    # Whichever asked first after the stop (a request, or the in-flight report every half second).
    failed = [_metric(text, f'llmgw_gateway_redis_errors_total{{op="{op}"}}') for op in ("limits", "inflight")]
    assert sum(failed) >= 1.0, failed
    assert _metric(text, 'llmgw_gateway_requests_total{code="200",model="demo"}') == 3.0
    assert _metric(text, 'llmgw_gateway_requests_total{code="429",model="demo"}') == 1.0
    # The whole log: the subscription's retries every 2 s, more of them the slower the machine, soon
    # push these lines out of the tail.
    log = g.log.read_text()
    assert "Redis unreachable" in log and "counted by this process alone" in log

    # Pushes are lost with Redis; the periodic refresh still brings a new model to the gateway.
    make_deployment("late", [url_of(echoes(model="late"))])
    g.wait_ready(key, "late", 1)

    own_redis.start()
    wait_for(lambda: _metric(g.metrics(), "llmgw_gateway_counters_local") == 0.0, timeout=20, what=g.tail)
    assert "Redis answers again" in g.log.read_text()


def test_every_error_is_openai_shaped_and_counted(gateway_factory, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    g = gateway_factory("errors-counted")
    g.wait_ready(key, "demo", 1)
    deep = b'{"model": "demo", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with g.client(key) as c:
        r = c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert c.post("/v1/chat/completions", json=chat("x", model="nope")).status_code == 404
    with g.client("wrong") as c:
        assert c.post("/v1/chat/completions", json=chat("x")).status_code == 401
    # Refused as a client error or failed inside: either way a JSON error in OpenAI's shape, counted.
    assert r.status_code in (400, 500), r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    text = g.metrics()
    assert _metric(text, f'llmgw_gateway_requests_total{{code="{r.status_code}",model=""}}') == 1.0
    # The model is a label only once routed: a client's made-up name is not one.
    assert _metric(text, 'llmgw_gateway_requests_total{code="404",model=""}') == 1.0
    assert _metric(text, 'llmgw_gateway_requests_total{code="401",model=""}') == 1.0
    assert "nope" not in text
