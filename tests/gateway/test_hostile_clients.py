"""Hostile clients at the gateway: trickled bodies are cut off, JSON nested thousands deep is a 400.

A real data plane (granian, ASGI) in front of an echo replica, with a 4 s body deadline.
"""

from __future__ import annotations

import httpx
import pytest

from bench.hostile import Trickle, request_head
from tests.gateway.conftest import chat, make_deployment, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BODY_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def gateway(gateway_factory):
    """A data plane giving a client 4 s to send its body."""
    return gateway_factory("hostile", extra_env={"LLMGW_BODY_TIMEOUT": str(BODY_TIMEOUT_S)})


def test_a_hundred_trickled_bodies_are_cut_off_and_stall_no_request(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    head = request_head("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
    trickle = Trickle("127.0.0.1", gateway.port, head, n=100).start()
    try:
        wait_for(lambda: trickle.open() == 100, timeout=5, what="100 trickling connections")
        with gateway.client(key, timeout=3) as c:
            for i in range(10):
                r = c.post("/v1/chat/completions", json=chat(f"hello {i}"))
                assert r.status_code == 200, r.text
        assert trickle.open() == 100, trickle.statuses()
        wait_for(lambda: trickle.open() == 0, timeout=BODY_TIMEOUT_S + 10, what=lambda: str(trickle.statuses()))
        assert trickle.statuses() == {408: 100}
        assert trickle.held_s() < BODY_TIMEOUT_S + 5
        answer = trickle.conns[0].answer.split(b"\r\n\r\n", 1)[1]
        assert httpx.Response(408, content=answer).json() == {
            "error": {
                "message": f"the body did not arrive within {BODY_TIMEOUT_S} s",
                "type": "invalid_request_error",
                "param": None,
                "code": "body_timeout",
            }
        }
    finally:
        trickle.stop()


def test_json_nested_ten_thousand_deep_is_a_400(gateway, echoes, user):
    key = make_key(user, name="deep")
    with gateway.client(key) as c:
        wait_for(lambda: c.get("/v1/models").status_code == 200, timeout=10, what="the key known")
    deep = b'{"model": "demo", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "the body nests arrays or objects too deeply",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
