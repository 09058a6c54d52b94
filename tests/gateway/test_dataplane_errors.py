"""Every way a request can fail at the gateway, as a client sees it: OpenAI's shape, a request id, no internals.

A real gateway process in front of echo replicas (one refusing connections,
one too slow for the gateway's 1 s upstream timeout, one crashing with a
traceback that names its address). Whatever fails, the answer says it in
words with a string code; the addresses, ports and exception text go to the
log, under the request's id.
"""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import chat, free_port, make_deployment, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LEAKS = ("127.0.0.1", "Error(", "Exception", "Traceback", "localhost")


@pytest.fixture(scope="module")
def gateway(gateway_factory):
    """A data plane that gives a replica 1 s to answer."""
    return gateway_factory("errors", extra_env={"LLMGW_GATEWAY_UPSTREAM_TIMEOUT": "1"})


def _clean(r: httpx.Response, ports: list[int]) -> dict:
    """The error of an answer that gives nothing of the inside away."""
    texts = [r.text, *(f"{k}: {v}" for k, v in r.headers.items())]
    for text in texts:
        for leak in (*LEAKS, *(str(p) for p in ports)):
            assert leak not in text, f"{leak!r} in {text!r}"
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["code"], str)
    return body["error"]


def test_every_error_path_in_openais_shape_without_internals(gateway, echoes, user):
    demo = echoes()
    slow = echoes(model="slow", prefill_tokens_per_s=0.5)  # 4 tokens: 8 s before the head of the answer
    crash = echoes(model="crash", fail_status=500)
    refused_port = free_port()
    make_deployment("demo", [url_of(demo)])
    make_deployment("slow", [url_of(slow)])
    make_deployment("crash", [url_of(crash)])
    make_deployment("refused", [f"http://127.0.0.1:{refused_port}"])
    make_deployment("big", [], desired=2, pending="3 free GPUs, needs 4")
    key = make_key(user)
    narrow = make_key(user, name="narrow", allowed_models=["big"])
    # The last one made: the table that has it has them all.
    gateway.wait_ready(key, "big", 0)
    ports = [p.server_address[1] for p in (demo, slow, crash)] + [refused_port, gateway.port]

    def post(path: str, rid: str, secret: str | None = key, **kw) -> httpx.Response:
        headers = {"x-request-id": rid}
        with gateway.client(secret, timeout=30) as c:
            r = c.post(path, headers=headers, **kw)
        assert r.headers["x-request-id"] == rid
        return r

    cases = [
        ("bad-json", "/v1/chat/completions", None, {"content": b"{nope"}, 400, "invalid_json", "body is not JSON"),
        (
            "array",
            "/v1/chat/completions",
            None,
            {"json": [chat("x")]},
            400,
            "invalid_body",
            "the body must be a JSON object, not an array",
        ),
        (
            "number",
            "/v1/embeddings",
            None,
            {"json": 3},
            400,
            "invalid_body",
            "the body must be a JSON object, not a number",
        ),
        ("no-key", "/v1/chat/completions", "", {"json": chat("x")}, 401, "missing_api_key", None),
        ("bad-key", "/v1/chat/completions", "llmgw-sk-nope", {"json": chat("x")}, 401, "invalid_api_key", None),
        ("narrow", "/v1/chat/completions", narrow, {"json": chat("x")}, 403, "model_not_allowed", None),
        (
            "unknown",
            "/v1/chat/completions",
            None,
            {"json": chat("x", model="nope")},
            404,
            "model_not_found",
            "the model 'nope' does not exist",
        ),
        (
            "none-ready",
            "/v1/chat/completions",
            None,
            {"json": chat("x", model="big")},
            503,
            "no_ready_replica",
            "big: 0 of 2 replicas ready; pending: 3 free GPUs, needs 4",
        ),
        (
            "refused",
            "/v1/completions",
            None,
            {"json": {"model": "refused", "prompt": "x"}},
            502,
            "upstream_failed",
            "the replica of model 'refused' could not be reached (connection refused)",
        ),
        (
            "slow",
            "/v1/chat/completions",
            None,
            {"json": chat("a b c", model="slow")},
            504,
            "upstream_timeout",
            "the replica of model 'slow' did not answer in time",
        ),
        (
            "crash",
            "/v1/completions",
            None,
            {"json": {"model": "crash", "prompt": "x"}},
            502,
            "upstream_failed",
            "the replica of model 'crash' answered with an error (HTTP 500)",
        ),
        (
            "engine-400",
            "/v1/chat/completions",
            None,
            {"json": {"model": "demo", "messages": []}},
            400,
            "invalid_request",
            "messages must be a non-empty list",
        ),
        (
            "no-route",
            "/v1/rerank",
            None,
            {"json": {"model": "demo", "query": "q", "documents": ["d"]}},
            404,
            "unsupported_route",
            "the echo engine of model 'demo' does not serve POST /v1/rerank",
        ),
    ]
    for rid, path, secret, kw, status, code, message in cases:
        r = post(path, f"case-{rid}", key if secret is None else secret or None, **kw)
        assert r.status_code == status, (rid, r.text)
        err = _clean(r, ports)
        assert err["code"] == code, (rid, err)
        if message is not None:
            assert err["message"] == message, (rid, err)
    assert demo.served == 0

    # The detail is in the log, under the request's id.
    for rid, inside in (("refused", f"127.0.0.1:{refused_port}"), ("slow", "TimeoutError"), ("crash", "HTTP 500")):
        wait_for(
            lambda rid=rid, inside=inside: any(
                f"request case-{rid} for {rid} failed" in line and inside in line
                for line in gateway.log.read_text(errors="replace").splitlines()
            ),
            timeout=5,
            what=lambda: gateway.tail(),
        )
    text = gateway.metrics()
    assert 'llmgw_gateway_upstream_failures_total{kind="refused",model="refused"} 2.0' in text
    assert 'llmgw_gateway_upstream_failures_total{kind="timeout",model="slow"} 2.0' in text
    assert 'llmgw_gateway_upstream_failures_total{kind="http_5xx",model="crash"} 1.0' in text


def test_every_answer_carries_a_request_id(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user)
    gateway.wait_ready(key, "demo", 1)
    with gateway.client(key) as c:
        ok = c.post("/v1/chat/completions", json=chat("x"), headers={"x-request-id": "mine-1"})
        assert (ok.status_code, ok.headers["x-request-id"]) == (200, "mine-1")
        made = {c.post("/v1/chat/completions", json=chat("x")).headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(len(m) == 32 for m in made)
        # One that could break a header or a log line is replaced.
        odd = c.post("/v1/chat/completions", json=chat("x"), headers={"x-request-id": "a b"})
        assert odd.headers["x-request-id"] != "a b"
        assert c.get("/v1/nowhere").headers["x-request-id"]
    assert httpx.get(f"{gateway.url}/health").headers["x-request-id"]
