"""The native server's HTTP/1.1 (gateway/dataplane/server.py), byte for byte, over a small ASGI application.

A real server on its own event loop in a thread, on a socket of its own;
the client is a plain socket, so what is asserted is what went on the wire:
pipelined requests answered in order, chunked request bodies, keep-alive and
its end, answers framed by length or chunks, a malformed or oversized head,
a head that does not arrive in time, a body left unread, a client gone
mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from typing import Any

import pytest
import uvloop

from gateway.dataplane.server import Server


async def app(scope: dict[str, Any], receive, send) -> None:
    """Echoes the request (as JSON), streams on /stream, refuses /big unread, fails on /fail."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("the application failed")
    if path == "/big":
        body = b'{"error": "too large"}'
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if path == "/forever":
        # Streams until the client leaves, then says how it learned of it.
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"tick", "more_body": True})
        message = await receive()
        if message["type"] == "http.request":
            message = await receive()
        GONE.append(message["type"])
        return
    READING.set()
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b"").decode())
        if not message.get("more_body"):
            break
    data = {
        "method": scope["method"],
        "path": path,
        "query": scope["query_string"].decode(),
        "body": "".join(parts),
        "parts": len(parts),
        "version": scope["http_version"],
        "host": dict(scope["headers"]).get(b"host", b"").decode(),
    }
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


GONE: list[str] = []
# Set as the echo application starts reading a body.
READING = threading.Event()


class Served:
    """The native server on 127.0.0.1 (a free port), on a uvloop event loop in a thread of its own."""

    def __init__(self, head_timeout: float = 30.0, application: Any = app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.head_timeout = head_timeout
        self.application = application
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.server: Server | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            self.server = Server(self.application, head_timeout=self.head_timeout)
            self.ready.set()
            await self.server.serve(self.sock, self.stop)

        uvloop.run(main())

    def close(self) -> None:
        """Stop the server (gracefully) and wait for its thread."""
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(20)


@pytest.fixture
def served():
    """A native server for one test."""
    s = Served()
    yield s
    s.close()


def talk(port: int, data: bytes | list[bytes], *, timeout: float = 10.0) -> bytes:
    """Send `data` (parts sent one by one), then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        for part in [data] if isinstance(data, bytes) else data:
            c.sendall(part)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    return out


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The answers in `raw`, in order: (status, headers but the date, body with any chunked framing removed)."""
    out = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        assert headers.pop("date", "").endswith(" GMT")
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, raw = raw[:n], raw[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, raw = raw.partition(b"\r\n")
                size = int(size_line, 16)
                body, raw = body + raw[:size], raw[size + 2 :]
                if size == 0:
                    break
        else:
            body, raw = raw, b""
        out.append((status, headers, body))
    return out


def request(method: str, path: str, body: bytes = b"", *headers: str, version: str = "1.1") -> bytes:
    """One request's bytes, with Host and (with a body) Content-Length."""
    lines = [f"{method} {path} HTTP/{version}", "Host: test", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def echoed(answer: tuple[int, dict[str, str], bytes]) -> dict:
    """The echo application's report of a request, from its answer."""
    assert answer[0] == 200 and answer[1]["content-type"] == "application/json"
    return json.loads(answer[2])


def test_pipelined_requests_are_answered_in_order_on_one_connection(served):
    raw = talk(
        served.port,
        request("GET", "/a?x=1")
        + request("POST", "/b", b"second")
        + request("GET", "/c%20d", b"", "Connection: close"),
    )
    got = answers(raw)
    assert [(a[0], echoed(a)["method"], echoed(a)["path"], echoed(a)["query"], echoed(a)["body"]) for a in got] == [
        (200, "GET", "/a", "x=1", ""),
        (200, "POST", "/b", "", "second"),
        (200, "GET", "/c d", "", ""),
    ]
    # Kept alive between them, closed after the last, which asked.
    assert [a[1].get("connection") for a in got] == [None, None, "close"]
    assert [a[1]["content-length"] for a in got] == [str(len(a[2])) for a in got]


def test_a_chunked_request_body_arriving_in_pieces_is_read_whole(served):
    head = b"POST /up HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    raw = talk(served.port, [head, b"5\r\nhello\r\n", b"6\r\n world\r\n", b"0\r\n\r\n"])
    [answer] = answers(raw)
    assert echoed(answer)["body"] == "hello world"
    assert echoed(answer)["parts"] >= 1


def test_a_body_split_across_writes_is_read_in_full(served):
    body = b"x" * 300_000
    data = request("POST", "/up", body, "Connection: close")
    raw = talk(served.port, [data[:100], data[100:150_000], data[150_000:]])
    [answer] = answers(raw)
    assert echoed(answer)["body"] == body.decode()


def test_keep_alive_serves_requests_one_after_another_until_the_client_leaves(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as c:
        for i in range(3):
            c.sendall(request("POST", f"/n{i}", f"body {i}".encode()))
            raw = b""
            while not raw.endswith(b"}"):
                raw += c.recv(65536)
            [answer] = answers(raw)
            assert (echoed(answer)["path"], echoed(answer)["body"]) == (f"/n{i}", f"body {i}")


def test_http_1_0_is_closed_after_its_answer_unless_it_asks_to_be_kept(served):
    [plain] = answers(talk(served.port, request("GET", "/old", version="1.0")))
    assert echoed(plain)["version"] == "1.0" and plain[1]["connection"] == "close"
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as c:
        c.sendall(request("GET", "/kept", b"", "Connection: keep-alive", version="1.0"))
        raw = b""
        while not raw.endswith(b"}"):
            raw += c.recv(65536)
        [kept] = answers(raw)
        assert kept[1]["connection"] == "keep-alive"


def test_a_streamed_answer_is_chunked_and_a_head_request_has_no_body(served):
    raw = talk(served.port, request("GET", "/stream", b"", "Connection: close"))
    assert raw.split(b"\r\n\r\n", 1)[1] == b"4\r\none \r\n3\r\ntwo\r\n0\r\n\r\n"
    [answer] = answers(raw)
    assert answer[:2] == (200, {"content-type": "text/plain", "transfer-encoding": "chunked", "connection": "close"})
    head = talk(served.port, request("HEAD", "/x", b"", "Connection: close"))
    assert head.endswith(b"\r\n\r\n") and b'"method"' not in head


def test_a_malformed_request_is_a_400_and_the_connection_closes(served):
    [answer] = answers(talk(served.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert answer == (
        400,
        {"content-type": "text/plain; charset=utf-8", "connection": "close", "content-length": "15"},
        b"400 Bad Request",
    )


def test_a_head_over_the_limit_is_a_431(served):
    big = "X-Big: " + "a" * 70_000
    raw = talk(served.port, request("GET", "/", b"", big))
    assert answers(raw)[0][0] == 431


def test_an_answer_sent_before_the_body_is_read_arrives_and_the_connection_ends(served):
    # Promised a megabyte, sent a part: the application refuses it unread; the rest is dropped.
    head = b"POST /big HTTP/1.1\r\nHost: test\r\nContent-Length: 1000000\r\n\r\n"
    raw = talk(served.port, [head, b"x" * 10_000])
    assert answers(raw) == [(413, {"content-type": "application/json", "content-length": "22", "connection": "close"},
                             b'{"error": "too large"}')]  # fmt: skip


def test_an_application_that_fails_before_answering_is_a_500(served):
    [answer] = answers(talk(served.port, request("GET", "/fail")))
    assert answer == (
        500,
        {"content-type": "text/plain; charset=utf-8", "content-length": "21", "connection": "close"},
        b"Internal Server Error",
    )


def test_a_client_gone_mid_stream_is_told_to_the_application(served):
    GONE.clear()
    c = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    c.sendall(request("GET", "/forever"))
    assert b"tick" in c.recv(65536)
    c.close()
    wait = threading.Event()
    for _ in range(200):
        if GONE:
            break
        wait.wait(0.05)
    assert GONE == ["http.disconnect"]


def test_a_head_that_does_not_arrive_in_time_is_a_408():
    s = Served(head_timeout=1.0)
    try:
        raw = talk(s.port, [b"GET / HTTP/1.1\r\nHost: te"], timeout=10)
    finally:
        s.close()
    assert answers(raw)[0][0] == 408


def test_a_stop_lets_the_request_in_hand_finish():
    s = Served()
    with contextlib.closing(socket.create_connection(("127.0.0.1", s.port), timeout=10)) as c:
        READING.clear()
        c.sendall(b"POST /up HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nhello")
        assert READING.wait(10)
        _stopping(s)
        c.sendall(b"world")
        raw = _until_closed(c)
    s.thread.join(20)
    [answer] = answers(raw)
    assert echoed(answer)["body"] == "helloworld" and answer[1]["connection"] == "close"


def _stopping(s: Served) -> None:
    """Tell the server to stop, and return once it has begun to."""
    s.loop.call_soon_threadsafe(s.stop.set)
    wait = threading.Event()
    while not s.server.stopping:
        wait.wait(0.01)


def _until_closed(c: socket.socket) -> bytes:
    raw = b""
    while chunk := c.recv(65536):
        raw += chunk
    return raw


def _answered_then_stopped(s: Served, c: socket.socket) -> bytes:
    """One request answered on `c`, kept alive; then the server told to stop. The first answer's bytes."""
    c.sendall(b"GET /first HTTP/1.1\r\nHost: test\r\n\r\n")
    first = b""
    while b'"path": "/first"' not in first:
        first += c.recv(65536)
    _stopping(s)
    return first


def test_a_stop_answers_the_request_an_idle_kept_alive_connection_sends_next_then_closes_it():
    # A kept-alive connection closed at once by a stopping worker reset the request its client was
    # sending on it just then; the stop leaves it open a moment and answers that request.
    s = Served()
    with contextlib.closing(socket.create_connection(("127.0.0.1", s.port), timeout=10)) as c:
        first = _answered_then_stopped(s, c)
        c.sendall(b"GET /second HTTP/1.1\r\nHost: test\r\n\r\n")
        raw = _until_closed(c)
    s.thread.join(20)
    [answer] = answers(raw)
    assert (echoed(answer)["path"], answer[1]["connection"]) == ("/second", "close")
    assert answers(first)[0][1].get("connection") != "close"


def test_a_stop_closes_an_idle_kept_alive_connection_after_its_linger():
    s = Served()
    with contextlib.closing(socket.create_connection(("127.0.0.1", s.port), timeout=10)) as c:
        _answered_then_stopped(s, c)
        # Nothing more is sent: the connection ends (an orderly close, no reset) once the linger is over.
        assert c.recv(65536) == b""
    s.thread.join(20)
    assert not s.thread.is_alive()


def test_a_client_that_expects_100_continue_is_asked_for_its_body(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as c:
        c.sendall(
            b"POST /up HTTP/1.1\r\nHost: test\r\nExpect: 100-continue\r\nContent-Length: 4\r\nConnection: close\r\n\r\n"
        )
        assert c.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        c.sendall(b"body")
        raw = b""
        while chunk := c.recv(65536):
            raw += chunk
    [answer] = answers(raw)
    assert echoed(answer)["body"] == "body"
