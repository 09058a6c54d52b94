"""The `echo` engine: a small, real OpenAI-compatible HTTP server that answers with what it is sent.

It stands in for vLLM where there is no GPU (tests, `manage.py simulate`): it
takes a configurable time to "load" (its /health answers 503 until then, as
the real engines do), lists its model, and answers chat and text completions
(streamed as server-sent events when asked, with the usage chunk when
`stream_options.include_usage` is set), embeddings and the Responses API
(`/v1/responses`, not streamed), in vLLM's shapes. It reflects what a client
asks of the answer's form, so that a router can be shown to pass it through:
`n` choices, a call of the first of `tools`, and with `response_format` a
JSON object `{"text": ...}`. Any other route is a 404.

So that routing can be measured without GPUs it simulates what matters to a
router: a prefix cache over fixed-size token blocks with an LRU capacity, a
prefill time proportional to the prompt tokens not found in it, a decode
rate, a bounded batch with a queue, and vLLM's metric names on /metrics
(requests running and waiting, KV-cache usage, prefix-cache queries and
hits). Tokens are whitespace-separated words.

    python -m llmgw_sim.echo --port 8001 --served-model-name demo --load-seconds 3
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 4 * 1024 * 1024


class PrefixCache:
    """A prefix cache over fixed-size token blocks with an LRU capacity, as vLLM's automatic prefix caching.

    A block is identified by its tokens and everything before it (a chained
    hash), so only a shared prefix hits: the same block after a different
    start is a different block.
    """

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        self.block_tokens = max(1, block_tokens)
        self.capacity = max(0, capacity_blocks)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def usage(self) -> float:
        """The fraction of the capacity in use (vLLM's kv_cache_usage_perc, 0 to 1)."""
        return len(self.blocks) / self.capacity if self.capacity else 0.0

    def admit(self, tokens: list[str]) -> int:
        """Look the prompt up, then keep its full blocks; the number of its tokens found cached."""
        n = self.block_tokens
        chain, hashes = 0, []
        for i in range(0, len(tokens) - len(tokens) % n, n):
            chain = hash((chain, tuple(tokens[i : i + n])))
            hashes.append(chain)
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hit += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        self.queries += len(tokens)
        self.hits += hit * n
        return hit * n


class EchoServer(ThreadingHTTPServer):
    """The HTTP server with the engine's state."""

    daemon_threads = True
    # The listen backlog of uvicorn, which vLLM serves with. socketserver's
    # default of 5 made the engine reset connections whenever a few dozen
    # clients connected at once: a failure of the stand-in, not of a router.
    request_queue_size = 2048

    def __init__(
        self,
        addr: tuple[str, int],
        *,
        model: str,
        load_seconds: float,
        token_seconds: float = 0.0,
        break_after_tokens: int = 0,
        prefill_tokens_per_s: float = 0.0,
        block_tokens: int = 16,
        cache_blocks: int = 2048,
        max_batch: int = 0,
        drop_first: int = 0,
        fail_status: int = 0,
    ) -> None:
        super().__init__(addr, Handler)
        self.cache = PrefixCache(block_tokens, cache_blocks)
        self.cache_lock = threading.Lock()
        # Seconds of prefill per prompt token not found in the cache (0: instant).
        self.prefill_seconds = 1.0 / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 0.0
        # A bounded batch: at most max_batch requests run, the rest wait (0: unbounded).
        self.batch = threading.BoundedSemaphore(max_batch) if max_batch > 0 else None
        self.running = 0
        self.waiting = 0
        self.model = model
        self.created = int(time.time())
        self.ready_at = time.monotonic() + max(0.0, load_seconds)
        # Time between two streamed tokens (the decode rate's inverse).
        self.token_seconds = max(0.0, token_seconds)
        # Fault injection: drop the connection after this many streamed tokens (0: never).
        self.break_after_tokens = break_after_tokens
        # Fault injection: close the connection of the first this many completions
        # without an answer, as an engine whose accept queue overflowed does.
        self.drop_first = drop_first
        self.dropped = 0
        # Fault injection: answer every completion with this status and a crashed engine's
        # traceback, addresses and all, as a server that lets its exceptions out does (0: never).
        self.fail_status = fail_status
        self._lock = threading.Lock()
        # What a test or a router can ask of it afterwards.
        self.served = 0
        self.cancelled = 0
        self.in_flight = 0

    def metrics(self) -> str:
        """The engine's /metrics in vLLM's names (those of vLLM 0.12 and later)."""
        label = f'{{model_name="{self.model}"}}'
        with self.cache_lock:
            usage, queries, hits = self.cache.usage(), self.cache.queries, self.cache.hits
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {usage}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{label} {float(queries)}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{label} {float(hits)}",
        ]
        return "\n".join(lines) + "\n"

    def prefill(self, tokens: list[str]) -> None:
        """Wait for a place in the batch, then spend the prefill time of the tokens the cache lacks."""
        if self.batch is not None:
            self.count("waiting")
            self.batch.acquire()
            self.count("waiting", -1)
        self.count("running")
        with self.cache_lock:
            hit = self.cache.admit(tokens)
        if self.prefill_seconds:
            time.sleep((len(tokens) - hit) * self.prefill_seconds)

    def finish(self) -> None:
        """Leave the batch."""
        self.count("running", -1)
        if self.batch is not None:
            self.batch.release()

    def count(self, name: str, delta: int = 1) -> None:
        """Add to one of the counters (served, cancelled, in_flight, dropped) under the lock."""
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def ready(self) -> bool:
        """Whether the pretend weights have finished loading."""
        return time.monotonic() >= self.ready_at


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _context_tokens(body: dict, *, chat: bool) -> list[str]:
    """The whole prompt as the engine would see it (every message, with its role), as tokens."""
    if chat:
        out: list[str] = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                out.append(f"<{m.get('role')}>")
                out.extend(_text_of(m.get("content")).split())
        return out
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt.split() if isinstance(prompt, str) else []


class Handler(BaseHTTPRequestHandler):
    """OpenAI-style endpoints: /health, /v1/models, chat and text completions, embeddings, responses."""

    server: EchoServer
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn sets: an answer's body written after its head otherwise
    # waited for the client's delayed ACK, 40 ms on every kept-alive request.
    disable_nagle_algorithm = True

    def log_message(self, fmt: str, *args: Any) -> None:
        sys.stderr.write(f"echo: {self.address_string()} {fmt % args}\n")

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def do_GET(self) -> None:
        if self.path == "/health":
            if self.server.ready():
                self._json(200, {"status": "ok"})
            else:
                self._json(503, {"status": "loading"})
        elif self.path == "/metrics":
            data = self.server.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            if not self.server.ready():
                return self._error(503, "model is loading", kind="service_unavailable")
            m = {"id": self.server.model, "object": "model", "created": self.server.created, "owned_by": "llmgw-echo"}
            self._json(200, {"object": "list", "data": [m]})
        else:
            self._error(404, f"no route {self.path}", kind="not_found")

    def _body(self) -> dict | None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0 or n > MAX_BODY:
            # The body stays unread, so the connection cannot carry another request.
            self.close_connection = True
            self._error(413 if n > MAX_BODY else 400, "bad Content-Length")
            return None
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._error(400, "body is not JSON")
            return None
        if not isinstance(body, dict):
            self._error(400, "body must be a JSON object")
            return None
        return body

    def _crash(self) -> None:
        host, port = self.server.server_address[:2]
        data = (
            "Traceback (most recent call last):\n"
            '  File "/opt/engine/serving.py", line 412, in generate\n'
            f'ConnectionError("peer {host}:{port} went away")\n'
        ).encode()
        self.send_response(self.server.fail_status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        self.server.count("in_flight")
        try:
            self._post()
        finally:
            self.server.count("in_flight", -1)

    def _embeddings(self, body: dict) -> None:
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs) or not inputs:
            return self._error(400, "input must be a string or a list of strings", param="input")
        data = []
        for i, text in enumerate(inputs):
            digest = hashlib.sha256(text.encode()).digest()
            vector: Any = [round(b / 255, 4) for b in digest[:8]]
            if body.get("encoding_format") == "base64":
                # As vLLM and OpenAI send it: little-endian float32s, base64-encoded.
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(t.split()) for t in inputs)
        self.server.count("served")
        self._json(
            200,
            {
                "object": "list",
                "data": data,
                "model": self.server.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )
        return None

    def _responses(self, body: dict) -> None:
        inputs = body.get("input")
        if isinstance(inputs, list) and inputs:
            users = [m for m in inputs if isinstance(m, dict) and m.get("role", "user") == "user"]
            inputs = _text_of((users or [{}])[-1].get("content"))
        if not isinstance(inputs, str):
            return self._error(400, "input must be a string or a non-empty list of messages", param="input")
        if body.get("stream"):
            return self._error(400, "the echo engine does not stream responses", param="stream")
        words = inputs.split()
        limit = body.get("max_output_tokens")
        out = words[:limit] if isinstance(limit, int) and limit >= 0 else words
        digest = hashlib.sha256(inputs.encode()).hexdigest()
        self.server.count("served")
        text = {"type": "output_text", "text": " ".join(out), "annotations": [], "logprobs": None}
        message = {"id": f"msg_{digest[:24]}", "type": "message", "role": "assistant", "status": "completed"}
        self._json(
            200,
            {
                "id": f"resp_{digest[:24]}",
                "object": "response",
                "created_at": int(time.time()),
                "model": self.server.model,
                "status": "completed",
                "output": [{**message, "content": [text]}],
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "usage": {
                    "input_tokens": len(words),
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": len(out),
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": len(words) + len(out),
                },
            },
        )
        return None

    def _post(self) -> None:
        if self.path not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
            # Read the refused body all the same: left unread on a kept-alive
            # connection it would be parsed as the next request (routers that
            # probe /tokenize first saw their next request fail that way).
            if self._body() is None:
                return None
            return self._error(404, f"no route {self.path}", kind="not_found")
        body = self._body()
        if body is None:
            return None
        if self.server.dropped < self.server.drop_first:
            self.server.count("dropped")
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if not self.server.ready():
            return self._error(503, "model is loading", kind="service_unavailable")
        if self.server.fail_status:
            return self._crash()
        model = body.get("model", self.server.model)
        if model != self.server.model:
            return self._error(404, f"the model {model!r} does not exist", kind="not_found", param="model")
        if self.path == "/v1/embeddings":
            return self._embeddings(body)
        if self.path == "/v1/responses":
            return self._responses(body)
        chat = self.path == "/v1/chat/completions"
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return self._error(400, "messages must be a non-empty list", param="messages")
            users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            text = _text_of((users or messages)[-1].get("content") if isinstance(messages[-1], dict) else "")
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list):
                prompt = prompt[0] if prompt else ""
            if not isinstance(prompt, str):
                return self._error(400, "prompt must be a string", param="prompt")
            text = prompt
        self.server.prefill(_context_tokens(body, chat=chat))
        try:
            return self._answer(body, text, chat=chat)
        finally:
            self.server.finish()

    def _answer(self, body: dict, text: str, *, chat: bool) -> None:
        words = text.split()
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens >= 0:
            words = words[:max_tokens]
        finish = "length" if isinstance(max_tokens, int) and len(text.split()) > len(words) else "stop"
        prompt_tokens = len(text.split())
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream"):
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return self._stream(ident, words, chat=chat, finish=finish, usage=usage if with_usage else None)
        self.server.count("served")
        n = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
        usage["completion_tokens"] *= n
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self._json(
            200,
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.server.model,
                "choices": [_choice(body, " ".join(words), i, finish, chat=chat) for i in range(n)],
                "usage": usage,
            },
        )
        return None

    def _stream(self, ident: str, words: list[str], *, chat: bool, finish: str, usage: dict | None) -> None:
        # Chunked, on a connection kept alive for the next request, as vLLM (uvicorn) answers.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(piece: str | None, finish_reason: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if piece is not None:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish_reason, "logprobs": None}
            msg = {"id": ident, "object": obj, "created": created, "model": self.server.model, "choices": [choice]}
            return f"data: {json.dumps(msg)}\n\n".encode()

        def write(data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        try:
            if chat:
                write(chunk(None, None, first=True))
            for i, w in enumerate(words):
                if self.server.break_after_tokens and i >= self.server.break_after_tokens:
                    # The engine dies mid-answer: the connection drops without an end.
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.server.token_seconds:
                    time.sleep(self.server.token_seconds)
                write(chunk(w if i == 0 else " " + w, None))
                self.wfile.flush()
            write(chunk(None if chat else "", finish))
            if usage is not None:
                last = {"id": ident, "object": obj, "created": created, "model": self.server.model}
                last.update({"choices": [], "usage": usage})
                write(f"data: {json.dumps(last)}\n\n".encode())
            write(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.server.count("served")
        except (BrokenPipeError, ConnectionResetError):
            # The client went away: a real engine aborts the request here.
            self.close_connection = True
            self.server.count("cancelled")


def _choice(body: dict, out: str, index: int, finish: str, *, chat: bool) -> dict[str, Any]:
    """One choice of a whole answer, in the form the request asked for (a tool's call, a JSON object)."""
    if not chat:
        return {"index": index, "text": out, "logprobs": None, "finish_reason": finish}
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict) and body.get("tool_choice") != "none":
        name = (tools[0].get("function") or {}).get("name", "")
        call = {
            "id": f"call_{hashlib.sha256(out.encode()).hexdigest()[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps({"text": out})},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"index": index, "message": message, "finish_reason": "tool_calls"}
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        out = json.dumps({"text": out})
    return {"index": index, "message": {"role": "assistant", "content": out}, "finish_reason": finish}


def serve(*, host: str, port: int, model: str, load_seconds: float, **options: Any) -> EchoServer:
    """Start an echo server in a background thread (for tests); stop it with .shutdown().

    `options`: token_seconds, break_after_tokens, drop_first, fail_status, prefill_tokens_per_s,
    block_tokens, cache_blocks, max_batch (see EchoServer). Unlike the command line, the
    defaults here cost no time.
    """
    server = EchoServer((host, port), model=model, load_seconds=load_seconds, **options)
    threading.Thread(target=server.serve_forever, name="echo", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    """Run the echo engine in the foreground until SIGTERM or SIGINT."""
    ap = argparse.ArgumentParser(prog="python -m llmgw_sim.echo", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default="echo")
    ap.add_argument("--load-seconds", type=float, default=0.0, help="how long /health answers 503 (loading)")
    # Defaults that behave like a small GPU.
    ap.add_argument("--token-seconds", type=float, default=0.01, help="time between two streamed tokens (decode)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=8000.0, help="prefill rate of uncached tokens")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens in a prefix-cache block")
    ap.add_argument("--cache-blocks", type=int, default=2048, help="prefix-cache capacity in blocks (LRU)")
    ap.add_argument("--max-batch", type=int, default=32, help="requests running at once; the rest wait")
    ap.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="keep running on SIGTERM, as an engine hung in shutdown does (to exercise SIGKILL)",
    )
    args = ap.parse_args(argv)
    server = EchoServer(
        (args.host, args.port),
        model=args.served_model_name,
        load_seconds=args.load_seconds,
        token_seconds=args.token_seconds,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        block_tokens=args.block_tokens,
        cache_blocks=args.cache_blocks,
        max_batch=args.max_batch,
    )

    def stop(signum, frame):
        if signum == signal.SIGTERM and args.ignore_sigterm:
            sys.stderr.write("echo: SIGTERM ignored\n")
            return
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stderr.write(
        f"echo: serving {args.served_model_name!r} on {args.host}:{server.server_address[1]}, "
        f"loading for {args.load_seconds}s\n"
    )
    sys.stderr.flush()
    server.serve_forever()
    server.server_close()
    sys.stderr.write("echo: stopped\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
