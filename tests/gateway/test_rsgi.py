"""The gateway served over granian's RSGI interface (gateway/rsgi.py) answers as over ASGI (gateway/asgi.py).

Two real processes on the same table and replica, one per interface, asked
the same requests: the data plane's routes, its errors, a stream, the probes,
and the agents' long-poll mounted in front of it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agents.wakeup import WAIT_PATH
from tests.gateway.conftest import chat, make_deployment, make_key, url_of

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# What each request's answer must agree on; the rest (date, the replica's id, the request id) may differ.
COMPARED = ("content-type", "content-length", "cache-control", "retry-after", "x-ratelimit-limit-requests")


def _answers(url: str, key: str) -> list[tuple]:
    auth = {"Authorization": f"Bearer {key}"}
    out = []
    with httpx.Client(base_url=url, timeout=10) as c:
        requests = [
            ("GET", "/health", {}, None),
            ("GET", "/readyz", {}, None),
            ("GET", "/v1/models", auth, None),
            ("POST", "/v1/chat/completions", auth, chat("one two three")),
            ("POST", "/v1/completions", auth, {"model": "demo", "prompt": "one two", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {}, chat("no key")),
            ("POST", "/v1/chat/completions", auth, {"model": "absent", "messages": []}),
            ("POST", "/v1/nowhere", auth, {"model": "demo"}),
            ("GET", "/v1/unknown", auth, None),
            # The agents' long-poll, mounted in front of the data plane: refused without a node's credential.
            ("GET", f"{WAIT_PATH}?node=absent", {}, None),
        ]
        for method, path, headers, body in requests:
            r = c.request(method, path, headers=headers, json=body)
            kept = {h: r.headers[h] for h in COMPARED if h in r.headers}
            text = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
            if isinstance(text, dict):
                text.pop("id", None)
                text.pop("created", None)
            out.append((method, path, r.status_code, kept, len(r.content), bool(r.headers.get("x-request-id")), text))
        with c.stream("POST", "/v1/chat/completions", headers=auth, json=chat("a b c", stream=True)) as r:
            events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
            events = [json.loads(e) if e != "[DONE]" else e for e in events]
            contents = [e if isinstance(e, str) else e["choices"][0]["delta"].get("content") for e in events]
            out.append(("stream", r.status_code, r.headers["content-type"], r.headers.get("cache-control"), contents))
    return out


def test_rsgi_answers_every_path_as_asgi_does(gateway_factory, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    rsgi = gateway_factory("rsgi", interface="rsgi")
    asgi = gateway_factory("asgi", interface="asgi")
    rsgi.wait_ready(key, "demo", 1)
    asgi.wait_ready(key, "demo", 1)
    over_rsgi, over_asgi = _answers(rsgi.url, key), _answers(asgi.url, key)
    assert over_rsgi == over_asgi
    by_path = {a[1]: a for a in over_rsgi if a[0] != "stream"}
    # A whole answer is sent with its length, in one write.
    chat_answer = next(a for a in over_rsgi if a[1] == "/v1/chat/completions" and a[2] == 200)
    assert chat_answer[3]["content-length"] == str(chat_answer[4])
    assert chat_answer[6]["choices"][0]["message"]["content"] == "one two three"
    assert by_path["/health"][2:] == (
        200,
        {"content-type": "application/json", "content-length": "29"},
        29,
        True,
        {"status": "ok", "models": 1},
    )
    assert by_path[f"{WAIT_PATH}?node=absent"][2] == 401
    assert over_rsgi[-1] == ("stream", 200, "text/event-stream", "no-cache", [None, "a", " b", " c", None, "[DONE]"])
