"""The real llama-server (built by `make llama-server`) on the tiny model tests/llamacpp.py writes:
it loads, answers the OpenAI routes the gateway forwards, streams, and reuses a shared prompt
prefix, which /metrics counts."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import gguf
import httpx
import pytest

from tests.llamacpp import (
    ALIAS,
    ENV,
    llama_server_binary,
    running_llama_server,
    start_llama_server,
    write_tiny_model,
)
from tests.ports import free_port_range

RECORDINGS = Path(__file__).parent / "fixtures/engines"
# A prompt long enough that a second request sharing it shows the cache at work.
PREFIX = "You are a terse assistant. Answer with one word only, and never explain the answer. " * 2


def metric(text: str, name: str) -> float:
    """The value of the one unlabelled sample `name` in Prometheus text."""
    (value,) = [line.split()[1] for line in text.splitlines() if line.split(" ")[0] == name]
    return float(value)


def test_the_tiny_model_has_the_shape_it_promises(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path))

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama"
    assert (field("llama.block_count"), field("llama.embedding_length"), field("llama.attention.head_count")) == (
        2,
        64,
        4,
    )
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 263
    assert field("tokenizer.ggml.model") == "gpt2"
    assert "<|im_start|>" in field("tokenizer.chat_template")
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert len(reader.tensors) == 3 + 9 * 2
    # The same seed writes the same bytes; another seed, other weights.
    assert write_tiny_model(tmp_path / "again.gguf").read_bytes() == path.read_bytes()
    assert write_tiny_model(tmp_path / "other.gguf", seed=1).read_bytes() != path.read_bytes()


def test_the_binary_skips_only_when_the_variable_is_unset(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="run `make llama-server`"):
        llama_server_binary()
    # Set but missing: `make test` promised a build, so the test fails rather than skip quietly.
    monkeypatch.setenv(ENV, str(tmp_path / "nowhere/llama-server"))
    with pytest.raises(pytest.fail.Exception, match=f"{ENV}=.*nowhere/llama-server is not an executable"):
        llama_server_binary()


@pytest.mark.slow
def test_version_is_printed_on_stderr(llama_server_bin):
    run = subprocess.run([llama_server_bin, "--version"], capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 0
    assert run.stdout == ""
    assert run.stderr.splitlines()[0] == "version: 0.6.0-dev (build 0, commit unknown)"


@pytest.mark.parametrize("flag", ["--version", "--help"])
@pytest.mark.slow
def test_the_recordings_are_what_this_build_prints(llama_server_bin, flag):
    # `make record-llama-server` wrote them from this build; a rebuild from other source shows here.
    run = subprocess.run([llama_server_bin, flag], capture_output=True, timeout=30, check=True)
    stem = RECORDINGS / f"llamacpp-11434-{flag.removeprefix('--')}"
    assert (run.stdout, run.stderr) == (
        Path(f"{stem}.stdout.txt").read_bytes(),
        Path(f"{stem}.stderr.txt").read_bytes(),
    )


@pytest.mark.slow
def test_health_chat_and_completions(llama_server):
    with httpx.Client(base_url=llama_server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [ALIAS]

        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": ALIAS,
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 8,
                "temperature": 0,
                # Random weights may pick the end token at any step; the length is then exact.
                "ignore_eos": True,
            },
        )
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert body["object"] == "chat.completion"
        assert body["model"] == ALIAS
        (choice,) = body["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
        # The ChatML rendering of one user message, tokenized by the server itself.
        rendered = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
        tokens = client.post("/tokenize", json={"content": rendered, "parse_special": True}).json()["tokens"]
        assert body["usage"]["prompt_tokens"] == len(tokens)

        completion = client.post(
            "/v1/completions",
            json={"model": ALIAS, "prompt": "hello the", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        )
        assert completion.status_code == 200, completion.text
        body = completion.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] == "length"
        # Byte-level BPE with the merges "h e" and "Ġt he": he, l, l, o, Ġthe.
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (5, 5)


@pytest.mark.slow
def test_a_streamed_chat_ends_with_done(llama_server):
    request = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(base_url=llama_server.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=request) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def _exchange(sock: socket.socket, request: dict) -> tuple[bytes, bytes]:
    """Send `request` as one keep-alive POST on `sock`; the answer's head and its whole body as sent."""
    body = json.dumps(request).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: llama\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer = b""
    while True:
        head, sep, rest = answer.partition(b"\r\n\r\n")
        if sep and b"transfer-encoding: chunked" in head.lower() and rest.endswith(b"\r\n0\r\n\r\n"):
            return head, rest
        if sep and b"content-length:" in head.lower():
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) >= length:
                assert len(rest) == length
                return head, rest
        data = sock.recv(65536)
        assert data, f"closed before the answer ended: {answer[-200:]!r}"
        answer += data


@pytest.mark.slow
def test_a_streamed_answer_closes_the_connection_its_head_kept_alive(llama_server):
    # This build's server ends every streamed answer by closing the connection, though the head
    # says Keep-Alive and not Connection: close (its chunked provider reports "no more" after
    # writing the last chunk, which its HTTP library takes for a cancelled write). A client that
    # pools the connection finds it closed on its next request: the gateway's pool sends that
    # request again on a new connection (tests/gateway/test_pool.py).
    chat = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    with socket.create_connection(("127.0.0.1", llama_server.port), timeout=30) as sock:
        head, body = _exchange(sock, {**chat, "stream": True})
        assert b"keep-alive: timeout=5, max=100" in head.lower()
        assert b"connection: close" not in head.lower()
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert sock.recv(65536) == b""  # then the end of the connection, nothing else
    # A plain answer keeps its promise: the same connection serves the next request.
    with socket.create_connection(("127.0.0.1", llama_server.port), timeout=30) as sock:
        for _ in range(2):
            head, body = _exchange(sock, chat)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert json.loads(body)["object"] == "chat.completion"


@pytest.mark.slow
def test_a_shared_prefix_is_served_from_the_cache_and_counted(llama_server):
    def ask(question):
        response = client.post(
            "/v1/completions",
            json={"model": ALIAS, "prompt": PREFIX + question, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        return response.json()

    with httpx.Client(base_url=llama_server.url, timeout=30) as client:
        first = ask("Is the sky blue?")
        second = ask("Is the sea wet?")
        metrics = client.get("/metrics")
    assert first["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert second["timings"]["cache_n"] == cached
    # Only the tokens after the shared part were processed again.
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached
    assert metrics.status_code == 200
    assert metric(metrics.text, "llamacpp:prompt_tokens_cached_total") == cached
    assert metric(metrics.text, "llamacpp:prompt_tokens_total") == (
        first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"] - cached
    )


@pytest.mark.slow
def test_a_server_that_cannot_start_says_why(llama_server_bin, tmp_path):
    model = tmp_path / "not-a-model.gguf"
    model.write_bytes(b"GGUF but not really")
    with pytest.raises(RuntimeError, match="llama-server exited with 1") as failure:
        start_llama_server(llama_server_bin, model, free_port_range(1), log=tmp_path / "log")
    assert "not-a-model.gguf" in str(failure.value)


@pytest.mark.slow
def test_stopping_ends_the_process_and_frees_the_port(llama_server_bin, tiny_model, tmp_path):
    with running_llama_server(llama_server_bin, tiny_model, tmp_path / "log") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.process.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
