"""The echo engine: a real OpenAI-compatible server that takes a while to load."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time

import httpx
import pytest

from llmgw_sim import echo


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


def test_a_refused_path_leaves_the_kept_alive_connection_usable(server):
    srv, url = server
    srv.ready_at = 0
    with httpx.Client(base_url=url) as client:
        r = client.post("/tokenize", json={"model": "demo", "prompt": "a long prompt " * 50})
        assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found")
        # The same connection: the refused body must not be read as this request.
        r = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        assert r.json()["object"] == "text_completion"


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


def test_streams_are_chunked_on_a_connection_kept_alive_and_the_socket_set_as_uvicorns(server):
    srv, url = server
    srv.ready_at = 0
    assert srv.request_queue_size == 2048
    assert srv.RequestHandlerClass.disable_nagle_algorithm
    body = {"model": "demo", "stream": True, "prompt": "x y"}
    with httpx.Client(base_url=url) as c:
        first = c.post("/v1/completions", json=body)
        peer = first.extensions["network_stream"].get_extra_info("client_addr")
        second = c.post("/v1/completions", json=body)
        assert second.extensions["network_stream"].get_extra_info("client_addr") == peer
    assert first.headers["transfer-encoding"] == "chunked"
    assert "connection" not in first.headers
    assert _events(second.text)[-1] == "[DONE]"


def test_dropped_requests_get_no_answer_then_the_rest_are_served():
    srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0, drop_first=1)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1/completions"
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(url, json={"model": "demo", "prompt": "x"})
        assert httpx.post(url, json={"model": "demo", "prompt": "x"}).json()["choices"][0]["text"] == "x"
        assert (srv.dropped, srv.served) == (1, 1)
    finally:
        srv.shutdown()
        srv.server_close()


def test_completion_streaming(server):
    srv, url = server
    srv.ready_at = 0
    with httpx.stream("POST", url + "/v1/completions", json={"model": "demo", "stream": True, "prompt": "x y"}) as r:
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "x y"


def test_prefix_cache_hits_only_shared_prefixes_and_evicts_lru():
    cache = echo.PrefixCache(block_tokens=2, capacity_blocks=3)
    assert cache.admit(["a", "b", "c", "d", "e"]) == 0  # two full blocks kept; "e" is a partial block
    assert cache.admit(["a", "b", "c", "d", "x", "y"]) == 4
    assert cache.admit(["z", "z", "c", "d"]) == 0  # the same block after another start is another block
    assert (cache.queries, cache.hits) == (15, 4)
    assert cache.usage() == 1.0  # capacity 3 blocks, LRU evicted the oldest
    assert cache.admit(["a", "b"]) == 0  # [a b] was least recently used and went


def test_metrics_in_vllm_names_and_prefill_costs_uncached_tokens():
    srv = echo.serve(
        host="127.0.0.1", port=0, model="demo", load_seconds=0, prefill_tokens_per_s=200, block_tokens=4, max_batch=1
    )
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        # 400 uncached tokens at 200/s: 2 s of prefill, a margin no busy machine's request overhead reaches.
        prompt = " ".join(f"t{i}" for i in range(400))
        t0 = time.monotonic()
        assert httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        assert httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        warm = time.monotonic() - t0
        assert cold >= 2.0
        assert warm < cold / 2  # all 400 tokens cached
        text = httpx.get(f"{url}/metrics").text
        assert 'vllm:num_requests_running{model_name="demo"} 0' in text
        assert 'vllm:num_requests_waiting{model_name="demo"} 0' in text
        assert 'vllm:prefix_cache_queries_total{model_name="demo"} 800.0' in text
        assert 'vllm:prefix_cache_hits_total{model_name="demo"} 400.0' in text
        assert 'vllm:kv_cache_usage_perc{model_name="demo"} 0.048828125' in text  # 100 of 2048 blocks
    finally:
        srv.shutdown()
        srv.server_close()


def test_bounded_batch_queues_the_rest():
    srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0, token_seconds=0.1, max_batch=1)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    body = {"prompt": "a b c d e f g h i j", "stream": True}
    codes: list[int] = []
    threads = [
        threading.Thread(target=lambda: codes.append(httpx.post(f"{url}/v1/completions", json=body).status_code))
        for _ in range(2)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while (srv.running, srv.waiting) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (srv.running, srv.waiting) == (1, 1)
        assert 'vllm:num_requests_waiting{model_name="demo"} 1' in httpx.get(f"{url}/metrics").text
        for t in threads:
            t.join(timeout=10)
        assert codes == [200, 200]
        # The client has its whole answer a moment before the server's own count drops: wait for it.
        deadline = time.monotonic() + 5
        while (srv.running, srv.waiting) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (srv.running, srv.waiting) == (0, 0)
    finally:
        srv.shutdown()
        srv.server_close()


def test_responses_as_vllm_shapes_them(server):
    srv, url = server
    srv.ready_at = 0
    r = httpx.post(url + "/v1/responses", json={"model": "demo", "input": "say one two three", "max_output_tokens": 2})
    assert r.status_code == 200
    body = r.json()
    assert (body["object"], body["status"], body["model"]) == ("response", "completed", "demo")
    assert body["id"].startswith("resp_")
    (item,) = body["output"]
    assert (item["type"], item["role"]) == ("message", "assistant")
    assert [(c["type"], c["text"]) for c in item["content"]] == [("output_text", "say one")]
    assert body["usage"]["input_tokens"] == 4
    assert (body["usage"]["output_tokens"], body["usage"]["total_tokens"]) == (2, 6)
    # Messages as input: the last user turn's text parts; the same input, the same answer.
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "a b"}]}]
    again = httpx.post(url + "/v1/responses", json={"model": "demo", "input": messages}).json()
    assert again["output"][0]["content"][0]["text"] == "a b"
    assert httpx.post(url + "/v1/responses", json={"model": "demo", "input": messages}).json()["id"] == again["id"]
    r = httpx.post(url + "/v1/responses", json={"model": "demo", "input": 3})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input")
    # Routes it does not serve stay a 404.
    r = httpx.post(url + "/v1/rerank", json={"model": "demo", "query": "q", "documents": ["d"]})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found")


def test_chat_reflects_n_tools_and_response_format(server):
    srv, url = server
    srv.ready_at = 0
    base = {"model": "demo", "messages": [{"role": "user", "content": "red green"}]}
    body = httpx.post(url + "/v1/chat/completions", json={**base, "n": 3}).json()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(i, "red green") for i in range(3)]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}

    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}
    (choice,) = httpx.post(url + "/v1/chat/completions", json={**base, "tools": [tool]}).json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert (call["type"], call["function"]["name"]) == ("function", "paint")
    assert json.loads(call["function"]["arguments"]) == {"text": "red green"}
    none = httpx.post(url + "/v1/chat/completions", json={**base, "tools": [tool], "tool_choice": "none"}).json()
    assert none["choices"][0]["message"] == {"role": "assistant", "content": "red green"}

    fmt = {**base, "response_format": {"type": "json_object"}}
    content = httpx.post(url + "/v1/chat/completions", json=fmt).json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"text": "red green"}


def test_fail_status_answers_a_crash_with_its_insides():
    srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0, fail_status=500)
    try:
        port = srv.server_address[1]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "demo", "prompt": "x"})
        assert r.status_code == 500
        assert r.text.startswith("Traceback (most recent call last):")
        assert f"127.0.0.1:{port}" in r.text
        assert srv.served == 0
    finally:
        srv.shutdown()
        srv.server_close()


def test_embeddings_as_floats_or_base64(server):
    srv, url = server
    srv.ready_at = 0
    floats = httpx.post(url + "/v1/embeddings", json={"model": "demo", "input": "a b"}).json()["data"][0]["embedding"]
    assert len(floats) == 8 and all(0 <= f <= 1 for f in floats)
    body = {"model": "demo", "input": "a b", "encoding_format": "base64"}
    packed = httpx.post(url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    decoded = struct.unpack("<8f", base64.b64decode(packed))
    assert decoded == pytest.approx(floats, abs=1e-6)
