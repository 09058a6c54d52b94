"""The data plane as a real process: the API and its errors, keys, streaming, cancellation, retries, ejection.

Each test creates its rows in the test database (committed: the gateway is
another process), the push reaches the gateway over Redis, and the test
calls the gateway over HTTP against echo replicas.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import threading
import time

import httpx
import pytest
from django.utils import timezone

from gateway import figures, keys, routing
from gateway.models import ApiKey, UsageMinute
from gateway.table import Backend
from tests.gateway.conftest import chat, make_deployment, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    assert {"message", "type", "code"} <= set(body["error"])
    return body["error"]


def test_models_and_completions_through_the_gateway(gateway, echoes, user):
    a, b = echoes(), echoes()
    make_deployment("demo", [url_of(a), url_of(b)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 2)
    with gateway.client(key) as c:
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [(m["id"], m["ready_replicas"], m["replicas"]) for m in models["data"]] == [("demo", 2, 2)]

        r = c.post("/v1/chat/completions", json=chat("hello there gateway"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello there gateway"}
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        assert r.headers["x-llmgw-replica"]

        r = c.post("/v1/completions", json={"model": "demo", "prompt": "one two", "max_tokens": 1})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == "one"

        r = c.post("/v1/embeddings", json={"model": "demo", "input": ["a b", "c"]})
        assert r.status_code == 200
        assert [d["index"] for d in r.json()["data"]] == [0, 1]
        assert r.json()["usage"]["prompt_tokens"] == 3
    assert a.served + b.served == 3


def test_models_retrieved_one_by_one(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    make_deployment("org/model-7b", [url_of(echoes(model="org/model-7b"))], desired=2)
    key = make_key(user, allowed_models=["demo", "org/model-7b"])
    narrow = make_key(user, name="narrow", allowed_models=["demo"])
    gateway.wait_ready(key, "org/model-7b", 1)
    with gateway.client(key) as c:
        r = c.get("/v1/models/org/model-7b")
        assert r.status_code == 200
        assert r.json() == {
            "id": "org/model-7b",
            "object": "model",
            "created": 0,
            "owned_by": "llmgw",
            "ready_replicas": 1,
            "replicas": 2,
        }
        r = c.get("/v1/models/nope")
        assert r.status_code == 404
        assert _error(r) == {
            "message": "the model 'nope' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    with gateway.client(narrow) as c:
        # A model the key may not use is not told apart from one that does not exist.
        r = c.get("/v1/models/org/model-7b")
        assert (r.status_code, _error(r)["message"]) == (404, "the model 'org/model-7b' does not exist")
        assert c.get("/v1/models/demo").json()["id"] == "demo"


def test_every_json_route_naming_a_model_is_routed_by_it(gateway, echoes, user):
    srv = echoes(model="resp")
    make_deployment("resp", [url_of(srv)])
    key = make_key(user)
    gateway.wait_ready(key, "resp", 1)
    with gateway.client(key) as c:
        r = c.post("/v1/responses", json={"model": "resp", "input": "one two three"})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "one two three"
        assert r.headers["x-llmgw-replica"]
        # A route the engine does not serve: its 404, named.
        r = c.post("/v1/score", json={"model": "resp", "text_1": "a", "text_2": "b"})
        assert r.status_code == 404
        assert _error(r)["message"] == "the echo engine of model 'resp' does not serve POST /v1/score"
        # Not a route at all: no dots, nothing outside /v1/.
        assert c.post("/v1/../admin", json={"model": "resp"}).status_code == 404
        assert c.post("/admin/x", json={"model": "resp"}).status_code == 404
    assert srv.served == 1
    # Its usage is counted as a chat's (the Responses API says input and output tokens).
    text = gateway.metrics()
    assert 'llmgw_gateway_tokens_total{kind="prompt",model="resp"} 3.0' in text
    assert 'llmgw_gateway_tokens_total{kind="completion",model="resp"} 3.0' in text
    assert 'llmgw_gateway_requests_total{code="404",model="resp"} 1.0' in text


def test_rate_limit_headers_on_success_and_429(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    limited = make_key(user, name="limited", rpm_limit=2, tpm_limit=100)
    free = make_key(user, name="free")
    gateway.wait_ready(limited, "demo", 1)
    reset = re.compile(r"(\d+ms|\d+(\.\d+)?s)")
    # The three requests inside one minute.
    wait_for(lambda: time.time() % 60 < 50, timeout=15, what="room left in this minute")
    with gateway.client(limited) as c:
        seen = []
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=chat("a b"))
            seen.append(
                (
                    r.status_code,
                    r.headers["x-ratelimit-limit-requests"],
                    r.headers["x-ratelimit-remaining-requests"],
                    r.headers["x-ratelimit-limit-tokens"],
                    r.headers["x-ratelimit-remaining-tokens"],
                )
            )
            assert reset.fullmatch(r.headers["x-ratelimit-reset-requests"]), r.headers
            assert r.headers["x-ratelimit-reset-tokens"] == r.headers["x-ratelimit-reset-requests"]
        # Each answer of 2 + 2 tokens is counted before the next request is judged.
        assert seen == [
            (200, "2", "1", "100", "100"),
            (200, "2", "0", "100", "96"),
            (429, "2", "0", "100", "92"),
        ]
    with gateway.client(free) as c:
        r = c.post("/v1/chat/completions", json=chat("a b"))
        assert r.status_code == 200
        assert [h for h in r.headers if h.startswith("x-ratelimit")] == []


def test_errors_in_openai_format(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    make_deployment("big", [], desired=2, pending="3 free GPUs, needs 4")
    key = make_key(user, allowed_models=["demo", "big"])
    narrow = make_key(user, name="narrow", allowed_models=["big"])
    gateway.wait_ready(key, "demo", 1)
    # (Replicas' changes are reloaded together, within a few milliseconds: wait for the second model too.)
    gateway.wait_ready(key, "big", 0)

    with gateway.client(None) as c:
        r = c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 401
        assert _error(r)["code"] == "missing_api_key"
    with gateway.client("llmgw-sk-wrong") as c:
        r = c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 401
        assert _error(r)["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
    with gateway.client(narrow) as c:
        r = c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 403
        assert _error(r) == {
            "message": "API key 'narrow' may not use 'demo'",
            "type": "permission_error",
            "param": "model",
            "code": "model_not_allowed",
        }
        assert list(gateway.models(narrow)) == ["big"]
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", json=chat("x", model="nope"))
        assert r.status_code == 404
        assert _error(r)["code"] == "model_not_found"
        assert _error(r)["param"] == "model"

        r = c.post("/v1/chat/completions", json=chat("x", model="big"))
        assert r.status_code == 503
        assert r.headers["retry-after"] == "5"
        assert _error(r)["message"] == "big: 0 of 2 replicas ready; pending: 3 free GPUs, needs 4"

        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        assert _error(r)["param"] == "model"


def test_revoked_and_expired_keys(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user, name="soon-revoked")
    expired = make_key(
        user, name="old", now=timezone.now() - dt.timedelta(hours=2), expires_at=timezone.now() - dt.timedelta(hours=1)
    )
    gateway.wait_ready(key, "demo", 1)
    with gateway.client(expired) as c:
        r = c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 401
        assert _error(r)["code"] == "expired_api_key"
    with gateway.client(key) as c:
        assert c.post("/v1/chat/completions", json=chat("x")).status_code == 200
        keys.revoke(ApiKey.objects.get(name="soon-revoked").id, now=timezone.now())
        # Revoking takes effect within a second (the push, not the 30 s refresh).
        wait_for(
            lambda: c.post("/v1/chat/completions", json=chat("x")).status_code == 401,
            timeout=1.0,
            what="revoked key refused",
        )


def test_streaming_passes_chunks_through_as_they_arrive(gateway, echoes, user):
    srv = echoes(token_seconds=0.2)
    make_deployment("demo", [url_of(srv)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    with gateway.client(key) as c, c.stream("POST", "/v1/chat/completions", json=chat("a b c d e f", stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        arrivals, events = [], []
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # OpenAI's documented loop runs: every chunk has a choice (no usage-only chunk the client did not ask for).
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert text == "a b c d e f"
    assert [ch for ch in chunks if "usage" in ch] == []
    # Not buffered: the first token came about a second before the last.
    assert arrivals[-1] - arrivals[1] >= 0.8


def _events(c: httpx.Client, path: str, body: dict) -> list:
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat("one two three", stream=True)),
        ("/v1/completions", {"model": "demo", "prompt": "one two three", "stream": True}),
    ],
)
def test_a_stream_carries_usage_only_when_the_client_asked(gateway, echoes, user, path, body):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    with gateway.client(key) as c:
        plain = _events(c, path, body)
        asked = _events(c, path, {**body, "stream_options": {"include_usage": True}})
        refused = _events(c, path, {**body, "stream_options": {"include_usage": False}})
    for events in (plain, refused):
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(len(ch["choices"]) == 1 and "usage" not in ch for ch in chunks), chunks
    # Asked for: passed through as the engine sent it, the usage-only chunk last.
    assert asked[-1] == "[DONE]"
    assert len(asked) == len(plain) + 1
    last = json.loads(asked[-2])
    assert (last["choices"], last["usage"]) == ([], usage)


def test_client_disconnect_cancels_upstream(gateway, echoes, user):
    srv = echoes(token_seconds=0.1)
    make_deployment("demo", [url_of(srv)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    with (
        gateway.client(key) as c,
        c.stream("POST", "/v1/chat/completions", json=chat(" ".join(["w"] * 200), stream=True)) as r,
    ):
        lines = r.iter_lines()
        next(lines)
        next(lines)
    # 200 tokens at 0.1 s would take 20 s: the engine is told within a couple of tokens.
    wait_for(lambda: srv.cancelled == 1, timeout=5, what=lambda: f"cancelled={srv.cancelled} served={srv.served}")
    assert srv.served == 0
    wait_for(lambda: srv.in_flight == 0, timeout=5, what="engine finished with the request")


def test_retry_once_before_first_byte_then_eject(gateway, echoes, user):
    good = echoes()
    loading = echoes(load_seconds=3600)  # answers 503 to every request
    reps = make_deployment("demo", [url_of(good), url_of(loading)])
    bad_id = str(reps[1].id)
    key = make_key(user)
    gateway.wait_ready(key, "demo", 2)
    # Three prompts whose home is the failing replica, then nine more of any home.
    home_bad = [_prompt_for(reps, reps[1], lambda i, n=n: chat(f"bad {n} prompt {i}")) for n in range(3)]
    with gateway.client(key) as c:
        # None fails: each 503 is retried on the good replica.
        codes = [c.post("/v1/chat/completions", json=body).status_code for body in home_bad]
        codes += [c.post("/v1/chat/completions", json=chat(f"prompt {i}")).status_code for i in range(9)]
    assert codes == [200] * 12
    assert good.served == 12
    text = gateway.metrics()
    # Three failures in a row eject it: after that it is not tried at all.
    assert f'llmgw_gateway_replica_ejected{{replica="{bad_id}"}} 1.0' in text
    assert "llmgw_gateway_retries_total 3.0" in text
    # And the admin's page of replicas at the gateway says so (the figures shared after each scrape).
    seen = wait_for(lambda: figures.read().get(bad_id), timeout=5, what="figures shared")
    wait_for(lambda: figures.read()[bad_id].ejected_for_s > 50, timeout=5, what=lambda: f"{figures.read()}")
    assert figures.read()[bad_id].failures == 3
    assert seen is not None


def test_connection_refused_is_retried(gateway, echoes, user):
    good = echoes()
    make_deployment("demo", ["http://127.0.0.1:9", url_of(good)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 2)
    with gateway.client(key) as c:
        codes = [c.post("/v1/completions", json={"model": "demo", "prompt": f"p{i}"}).status_code for i in range(6)]
    assert codes == [200] * 6
    assert good.served == 6


def test_a_connection_dropped_before_the_answer_is_asked_again_of_the_only_replica(gateway, echoes, user):
    # As an engine resets a connection when its accept queue overflows under load.
    only = echoes(drop_first=1)
    (rep,) = make_deployment("demo", [url_of(only)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", json=chat("one two three", stream=True))
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == str(rep.id)
    assert r.text.rstrip().endswith("data: [DONE]")
    # The engine counts an answer served once it has written it all, a moment after the client read it.
    wait_for(lambda: (only.dropped, only.served) == (1, 1), timeout=5, what=lambda: f"{only.dropped}, {only.served}")


def _prompt_for(replicas, target, body_of):
    """A body whose routing key sends it to `target` (the gateway's own pure choice, with nothing in flight)."""
    backends = [Backend(str(r.id), r.endpoint, "echo", "", "demo") for r in replicas]
    for i in range(200):
        body = body_of(i)
        if routing.choose(backends, hashes=(), start=routing.conversation_start(body), load={}).id == str(target.id):
            return body
    raise AssertionError("no prompt maps to the target")


def test_never_retried_after_the_first_byte(gateway, echoes, user):
    dying = echoes(break_after_tokens=2)
    other = echoes()
    reps = make_deployment("demo", [url_of(dying), url_of(other)])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 2)
    body = _prompt_for(reps, reps[0], lambda i: chat(f"q{i} one two three four five", stream=True))
    data = b""
    with gateway.client(key) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["x-llmgw-replica"] == str(reps[0].id)
        with contextlib.suppress(httpx.HTTPError):
            for chunk in r.iter_raw():
                data += chunk
    # The client got the first tokens and a broken end; no other replica was asked.
    assert b'"content": "q' in data
    assert b"[DONE]" not in data
    assert other.served == 0
    assert other.in_flight == 0


def test_limits_hold_across_two_gateway_processes(gateway, gateway_factory, echoes, user):
    second = gateway_factory("second")
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user, name="limited", rpm_limit=4)
    tokens = make_key(user, name="tokens", tpm_limit=10)
    for g in (gateway, second):
        g.wait_ready(key, "demo", 1)
    # Limits count per minute: start with the rest of this test inside one.
    wait_for(lambda: time.time() % 60 < 40, timeout=25, what="a fresh minute")
    with gateway.client(key) as c1, second.client(key) as c2:
        codes = [c.post("/v1/completions", json={"model": "demo", "prompt": "a"}).status_code for c in (c1, c2) * 3]
        assert codes == [200, 200, 200, 200, 429, 429]
        r = c1.post("/v1/completions", json={"model": "demo", "prompt": "a"})
        assert r.status_code == 429
        assert _error(r)["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 60
    with gateway.client(tokens) as c1, second.client(tokens) as c2:
        # 6 + 6 tokens: the second request is admitted (10 not yet reached), the third is not.
        assert c1.post("/v1/completions", json={"model": "demo", "prompt": "a b c"}).status_code == 200
        assert c2.post("/v1/completions", json={"model": "demo", "prompt": "a b c"}).status_code == 200
        assert c1.post("/v1/completions", json={"model": "demo", "prompt": "a"}).status_code == 429


def test_usage_counted_exactly_for_a_known_workload(gateway_factory, echoes, user):
    g = gateway_factory("usage", extra_env={"LLMGW_GATEWAY_USAGE_FLUSH": "0.3"})
    make_deployment("demo", [url_of(echoes()), url_of(echoes())])
    make_deployment("other", [url_of(echoes(model="other"))])
    key = make_key(user, name="metered")
    g.wait_ready(key, "demo", 2)
    g.wait_ready(key, "other", 1)
    with g.client(key) as c:
        for i in range(5):  # 3 prompt + 3 completion tokens each
            assert c.post("/v1/chat/completions", json=chat(f"x{i} y z")).status_code == 200
        for i in range(3):  # streamed: 2 + 2 each, from the usage chunk the gateway asks for
            with c.stream("POST", "/v1/completions", json={"model": "demo", "prompt": f"s{i} t", "stream": True}) as r:
                assert r.status_code == 200
                r.read()
        assert c.post("/v1/chat/completions", json=chat("one", model="other")).status_code == 200
        # The engine refuses it: counted as a request and an error, with no tokens.
        assert c.post("/v1/chat/completions", json={"model": "demo", "messages": []}).status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 400  # no model: not counted

    def rows():
        return {
            r.model: (r.requests, r.prompt_tokens, r.completion_tokens, r.errors, r.ttft_count)
            for r in UsageMinute.objects.filter(key__name="metered")
        }

    expected = {"demo": (9, 21, 21, 1, 9), "other": (1, 1, 1, 0, 1)}
    wait_for(
        lambda: _merged(UsageMinute.objects.filter(key__name="metered")) == expected,
        timeout=10,
        what=lambda: f"usage rows {rows()}",
    )
    text = g.metrics()
    assert 'llmgw_gateway_requests_total{code="200",model="demo"} 8.0' in text
    assert 'llmgw_gateway_tokens_total{kind="prompt",model="demo"} 21.0' in text
    assert 'llmgw_gateway_tokens_total{kind="completion",model="other"} 1.0' in text
    assert 'llmgw_gateway_ttft_seconds_count{model="demo"} 9.0' in text
    assert 'llmgw_gateway_requests_total{code="400",model="demo"} 1.0' in text
    assert 'llmgw_gateway_request_seconds_count{model="demo"} 9.0' in text
    # Nothing in flight once the workload is done: every routed replica reads 0.
    inflight = [line for line in text.splitlines() if line.startswith("llmgw_gateway_inflight{")]
    assert len(inflight) == 3 and all(line.endswith(" 0.0") for line in inflight)


def _merged(qs) -> dict:
    """Rows summed per model (a workload may straddle a minute boundary)."""
    out: dict[str, list[int]] = {}
    for r in qs:
        acc = out.setdefault(r.model, [0, 0, 0, 0, 0])
        for i, v in enumerate((r.requests, r.prompt_tokens, r.completion_tokens, r.errors, r.ttft_count)):
            acc[i] += v
    return {m: tuple(v) for m, v in out.items()}


def test_routing_follows_prefixes_and_backs_off_a_busy_replica(gateway, echoes, user):
    servers = [echoes() for _ in range(4)]
    reps = make_deployment("demo", [url_of(s) for s in servers])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 4)
    where: dict[int, set[str]] = {}
    with gateway.client(key) as c:
        for conv in range(12):
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"conversation {conv} question {turn}"})
                r = c.post("/v1/chat/completions", json={"model": "demo", "messages": messages})
                assert r.status_code == 200
                where.setdefault(conv, set()).add(r.headers["x-llmgw-replica"])
                messages.append(r.json()["choices"][0]["message"])
    # Every turn of a conversation went to one replica; the conversations spread over several.
    assert all(len(v) == 1 for v in where.values())
    assert len(set().union(*where.values())) >= 3

    # Make one replica markedly busier (its engine queues 10 requests it was sent directly) ...
    busy = echoes(model="busy", token_seconds=0.05, max_batch=1)
    for s in servers:
        s.shutdown()
        s.server_close()
    idle = [echoes(model="busy") for _ in range(3)]
    reps = make_deployment("busy", [url_of(busy)] + [url_of(s) for s in idle])
    gateway.wait_ready(key, "busy", 4)
    body = _prompt_for(reps, reps[0], lambda i: {"model": "busy", "messages": [{"role": "user", "content": f"h{i}"}]})
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            httpx.post(f"{url_of(busy)}/v1/completions", json={"prompt": "x " * 20, "stream": True}, timeout=30)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: busy.waiting >= 8, timeout=10, what=lambda: f"busy engine queue {busy.waiting}")
        # The gateway has read it (its figures are what it routes by).
        wait_for(
            lambda: (figures.read().get(str(reps[0].id)) or figures.Figures(0, 0, 0, 0, 0, 0, 0)).waiting >= 8,
            timeout=10,
            what=lambda: f"gateway's figures {figures.read().get(str(reps[0].id))}",
        )

        # ... the gateway reads it from the engine's /metrics and sends that prefix elsewhere.
        tries: list[str] = []

        def routed_elsewhere():
            # One try sent to the busy replica (the gateway's figure of it a scrape too old on a
            # loaded machine) would queue there for seconds: a try gives up after 2 s and the
            # condition is asked again, so the wait is on the routing, not on one request's moment.
            t0 = time.monotonic()
            try:
                with gateway.client(key, timeout=2) as c:
                    r = c.post("/v1/chat/completions", json=body)
            except httpx.TimeoutException:
                tries.append(f"timed out after {time.monotonic() - t0:.2f}s")
                return False
            tries.append(f"{r.status_code} {r.headers.get('x-llmgw-replica')} {time.monotonic() - t0:.2f}s")
            return r.status_code == 200 and r.headers["x-llmgw-replica"] != str(reps[0].id)

        wait_for(routed_elsewhere, timeout=20, what=lambda: f"the busy replica passed over: {tries} busy={reps[0].id}")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    # Idle again: the prefix stays where it spilled to, since that replica now holds it in its cache.
    wait_for(lambda: busy.waiting == 0 and busy.running == 0, timeout=20, what="busy engine drained")
    spilled_to = tries[-1].split()[1]
    with gateway.client(key) as c:
        assert [c.post("/v1/chat/completions", json=body).headers["x-llmgw-replica"] for _ in range(3)] == [
            spilled_to
        ] * 3


def test_failing_everywhere_is_502_then_503_once_all_are_ejected(gateway, user):
    reps = make_deployment("down", ["http://127.0.0.1:9", "http://127.0.0.1:7"])
    key = make_key(user)
    gateway.wait_ready(key, "down", 2)
    with gateway.client(key) as c:
        for _ in range(3):  # each request tries both once: three failures in a row eject both
            r = c.post("/v1/completions", json={"model": "down", "prompt": "x"})
            assert r.status_code == 502
            assert _error(r)["code"] == "upstream_failed"
        r = c.post("/v1/completions", json={"model": "down", "prompt": "x"})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "5"
        assert _error(r)["message"] == "down: 2 of 2 replicas ready (2 ejected after repeated failures)"
    text = gateway.metrics()
    for rep in reps:
        assert f'llmgw_gateway_replica_ejected{{replica="{rep.id}"}} 1.0' in text
