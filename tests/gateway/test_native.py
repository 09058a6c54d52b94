"""The gateway on its native server (gateway/native.py) answers as on granian's ASGI (gateway/asgi.py).

Real processes on the same table and replica, asked the same requests (the
data plane's routes, its errors, a stream, the probes, the agents' long-poll
mounted in front); then what only the server decides: a body over the cap,
a body trickled past its deadline, a client gone mid-stream.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from bench.hostile import Trickle, request_head
from gateway.dataplane.app import MAX_BODY
from tests.gateway.conftest import chat, make_deployment, make_key, url_of, wait_for
from tests.gateway.test_rsgi import _answers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BODY_TIMEOUT_S = 2


def test_native_answers_every_path_as_asgi_does(gateway_factory, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    native = gateway_factory("native", interface="native")
    asgi = gateway_factory("asgi", interface="asgi")
    native.wait_ready(key, "demo", 1)
    asgi.wait_ready(key, "demo", 1)
    over_native, over_asgi = _answers(native.url, key), _answers(asgi.url, key)
    assert over_native == over_asgi
    assert over_native[-1] == ("stream", 200, "text/event-stream", "no-cache", [None, "a", " b", " c", None, "[DONE]"])


def test_a_body_over_the_cap_is_a_413_and_a_trickled_one_a_408(gateway_factory, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    g = gateway_factory("native-hostile", interface="native", extra_env={"LLMGW_BODY_TIMEOUT": str(BODY_TIMEOUT_S)})
    g.wait_ready(key, "demo", 1)
    with g.client(key) as c:
        r = c.post("/v1/chat/completions", content=b" " * (MAX_BODY + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "too_large"
    head = request_head("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
    trickle = Trickle("127.0.0.1", g.port, head, n=5).start()
    try:
        wait_for(lambda: trickle.open() == 0, timeout=BODY_TIMEOUT_S + 10, what=lambda: str(trickle.statuses()))
        assert trickle.statuses() == {408: 5}
        assert httpx.Response(408, content=trickle.conns[0].answer.split(b"\r\n\r\n", 1)[1]).json()["error"] == {
            "message": f"the body did not arrive within {BODY_TIMEOUT_S} s",
            "type": "invalid_request_error",
            "param": None,
            "code": "body_timeout",
        }
    finally:
        trickle.stop()
    # Still answering, on a kept-alive connection.
    with g.client(key) as c:
        assert [c.post("/v1/chat/completions", json=chat(f"hi {i}")).status_code for i in range(3)] == [200] * 3


def test_a_client_gone_mid_stream_cancels_the_replica_and_is_counted_499(gateway_factory, echoes, user):
    srv = echoes(token_seconds=0.1)
    make_deployment("demo", [url_of(srv)])
    key = make_key(user)
    g = gateway_factory("native-gone", interface="native")
    g.wait_ready(key, "demo", 1)
    body = httpx.Request("POST", "http://x/", json=chat(" ".join(["w"] * 200), stream=True)).content
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %b\r\nContent-Length: %d\r\n\r\n%b" % (key.encode(), len(body), body)
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    # 200 tokens at 0.1 s would take 20 s: the engine is told within a couple of tokens.
    wait_for(lambda: srv.cancelled == 1, timeout=5, what=lambda: f"cancelled={srv.cancelled} served={srv.served}")
    assert srv.served == 0
    counted = [x for x in g.metrics().splitlines() if x.startswith("llmgw_gateway_requests_total{") and "demo" in x]
    assert counted == ['llmgw_gateway_requests_total{code="499",model="demo"} 1.0']
