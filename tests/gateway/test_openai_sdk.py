"""The gateway as OpenAI's official Python SDK sees it: every call is the SDK's, against a real gateway process.

Echo replicas stand behind it; they reflect what they were asked (`n`, the
first of `tools`, `response_format`), so what the SDK sent is shown to have
reached the engine. The SDK's own retries are off: each call is one request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import REPO, chat, make_deployment, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Where `make js-sdk` installs OpenAI's JavaScript SDK from the npm registry.
JS_SDK = REPO / "var" / "js-sdk"
USER = [{"role": "user", "content": "one two three"}]


def _client(gateway, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture
def client(gateway, echoes, user) -> OpenAI:
    """An SDK client with a key for `demo`, served by one echo replica."""
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user, name="sdk")
    gateway.wait_ready(key, "demo", 1)
    return _client(gateway, key)


def test_models_listed_and_retrieved(client):
    assert [m.id for m in client.models.list()] == ["demo"]
    model = client.models.retrieve("demo")
    assert (model.id, model.object, model.owned_by) == ("demo", "model", "llmgw")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert (e.value.status_code, e.value.code, e.value.param) == (404, "model_not_found", "model")


def test_chat_with_n_tools_and_response_format_passed_through(client):
    plain = client.chat.completions.create(model="demo", messages=USER)
    assert plain.choices[0].message.content == "one two three"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == (3, 3, 6)

    several = client.chat.completions.create(model="demo", messages=USER, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert {c.message.content for c in several.choices} == {"one two three"}

    tool = {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}
    called = client.chat.completions.create(model="demo", messages=USER, tools=[tool])
    (choice,) = called.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "count")
    assert json.loads(call.function.arguments) == {"text": "one two three"}

    shaped = client.chat.completions.create(model="demo", messages=USER, response_format={"type": "json_object"})
    assert json.loads(shaped.choices[0].message.content) == {"text": "one two three"}


def test_chat_streamed_as_the_documentation_loops(client, capsys):
    stream = client.chat.completions.create(model="demo", messages=USER, stream=True)
    # OpenAI's documented loop, as it is written: no IndexError on a usage-only chunk.
    chunks = []
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="")
        chunks.append(chunk)
    assert capsys.readouterr().out == "one two three"
    assert [c.usage for c in chunks] == [None] * len(chunks)

    asked = list(
        client.chat.completions.create(model="demo", messages=USER, stream=True, stream_options={"include_usage": True})
    )
    # Asked for: the usage-only chunk comes last, after as many chunks as without.
    assert len(asked) == len(chunks) + 1
    assert asked[-1].choices == []
    assert (asked[-1].usage.prompt_tokens, asked[-1].usage.total_tokens) == (3, 6)
    assert "".join(c.choices[0].delta.content or "" for c in asked[:-1]) == "one two three"


def test_completions_plain_and_streamed(client):
    done = client.completions.create(model="demo", prompt="alpha beta gamma", max_tokens=2)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("alpha beta", "length")
    assert done.usage.completion_tokens == 2
    pieces = [c.choices[0].text for c in client.completions.create(model="demo", prompt="alpha beta", stream=True)]
    assert "".join(pieces) == "alpha beta"


def test_embeddings(client):
    out = client.embeddings.create(model="demo", input=["a b", "c"])
    assert [d.index for d in out.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in out.data)
    assert out.usage.prompt_tokens == 3
    # The SDK asks for base64 unless told: the same text, the same vector (to float32's precision) either way.
    again = client.embeddings.create(model="demo", input="a b", encoding_format="float")
    assert again.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)


def test_responses(client):
    response = client.responses.create(model="demo", input="the answer is here", max_output_tokens=3)
    assert response.status == "completed"
    assert response.output_text == "the answer is"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (4, 3)


def test_every_error_class_the_gateway_causes_with_a_string_code(gateway, client, user):
    make_deployment("big", [], desired=1, pending="no GPU free")
    make_deployment("down", ["http://127.0.0.1:9"])
    gateway.wait_ready(make_key(user, name="probe"), "down", 1)

    def raised(kind, c: OpenAI, **kw):
        with pytest.raises(kind) as e:
            c.chat.completions.create(**{"model": "demo", "messages": USER, **kw})
        assert isinstance(e.value.code, str)
        return e.value.status_code, e.value.code

    assert raised(openai.AuthenticationError, _client(gateway, "llmgw-sk-wrong")) == (401, "invalid_api_key")
    narrow = _client(gateway, make_key(user, name="narrow", allowed_models=["big"]))
    assert raised(openai.PermissionDeniedError, narrow) == (403, "model_not_allowed")
    assert raised(openai.NotFoundError, client, model="nope") == (404, "model_not_found")
    # The engine's own refusal, its numeric code made a string.
    assert raised(openai.BadRequestError, client, messages=[]) == (400, "invalid_request")
    assert raised(openai.InternalServerError, client, model="big") == (503, "no_ready_replica")
    assert raised(openai.InternalServerError, client, model="down") == (502, "upstream_failed")

    limited = _client(gateway, make_key(user, name="one-a-minute", rpm_limit=1))
    wait_for(lambda: time.time() % 60 < 50, timeout=15, what="room left in this minute")
    limited.chat.completions.create(model="demo", messages=USER)
    assert raised(openai.RateLimitError, limited) == (429, "rate_limit_exceeded")


def test_rate_limit_headers_read_back_from_the_raw_response(gateway, client, user):
    limited = _client(gateway, make_key(user, name="limited", rpm_limit=50, tpm_limit=1000))
    wait_for(lambda: time.time() % 60 < 50, timeout=15, what="room left in this minute")
    raw = limited.chat.completions.with_raw_response.create(**chat("a b c"))
    assert raw.headers["x-ratelimit-limit-requests"] == "50"
    assert raw.headers["x-ratelimit-remaining-requests"] == "49"
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "1000"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    assert raw.headers["x-request-id"]
    assert raw.parse().choices[0].message.content == "a b c"
    second = limited.chat.completions.with_raw_response.create(**chat("a"))
    assert second.headers["x-ratelimit-remaining-tokens"] == "994"


def test_javascript_sdk_chat_and_streamed_chat(gateway, echoes, user):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: OpenAI's JavaScript SDK cannot run")
    assert (JS_SDK / "node_modules" / "openai" / "package.json").exists(), (
        f"OpenAI's JavaScript SDK is not installed under {JS_SDK}: run `make js-sdk`"
    )
    make_deployment("demo", [url_of(echoes())])
    key = make_key(user, name="js")
    gateway.wait_ready(key, "demo", 1)
    run = subprocess.run(
        [node, str(Path(__file__).with_name("openai_sdk_smoke.cjs"))],
        env={**os.environ, "BASE_URL": f"{gateway.url}/v1", "API_KEY": key, "NODE_PATH": str(JS_SDK / "node_modules")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["content"] == "one two three"
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert (got["streamed"], got["usage_chunks"]) == ("one two three", 0)
    assert got["chunks"] == 5  # the role, three words, the finish
