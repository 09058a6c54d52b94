"""The echo engine: a real OpenAI-compatible server that takes a while to load."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from agents.node import echo


@pytest.fixture
def server():
    srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0.3)
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_health_loading_then_ok(server):
    srv, url = server
    # Loading for as long as this part of the test takes, however loaded the machine: a 0.3 s
    # load was over before the second request on a busy machine.
    srv.ready_at = time.monotonic() + 3600
    r = httpx.get(url + "/health")
    assert (r.status_code, r.json()) == (503, {"status": "loading"})
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    # Then its load ends: healthy from that moment on.
    srv.ready_at = time.monotonic() + 0.3
    deadline = time.monotonic() + 30
    while (r := httpx.get(url + "/health")).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert time.monotonic() >= srv.ready_at


def test_models(server):
    srv, url = server
    srv.ready_at = 0
    body = httpx.get(url + "/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [("demo", "model")]


def test_chat_completion(server):
    srv, url = server
    srv.ready_at = 0
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "demo",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi there"}],
        },
    )
    body = r.json()
    assert r.status_code == 200
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi there"}}
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_completion_max_tokens(server):
    srv, url = server
    srv.ready_at = 0
    body = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "a b c d", "max_tokens": 2}).json()
    assert body["object"] == "text_completion"
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("a b", "length")


def test_unknown_model_and_bad_body(server):
    srv, url = server
    srv.ready_at = 0
    r = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "demo", "messages": []})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
    r = httpx.post(url + "/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_chat_streaming(server):
    srv, url = server
    srv.ready_at = 0
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"model": "demo", "stream": True, "messages": [{"role": "user", "content": "one two three"}]},
    ) as r:
        assert r.headers["content-type"] == "text/event-stream"
        text = r.read().decode()
    events = _events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_streaming(server):
    srv, url = server
    srv.ready_at = 0
    with httpx.stream("POST", url + "/v1/completions", json={"model": "demo", "stream": True, "prompt": "x y"}) as r:
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "x y"
