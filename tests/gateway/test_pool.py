"""The data plane's connections to replicas: framing, reuse, a connection the replica closed, failures."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import generate_latest

from gateway.dataplane.metrics import Metrics
from gateway.dataplane.pool import Pool, UpstreamError
from llmgw_sim import echo
from tests.gateway.conftest import free_port, url_of

HEADERS = b"Content-Type: application/json\r\n"


def _pool() -> Pool:
    return Pool(connect_timeout=2, read_timeout=5, keepalive_expiry=30, max_idle=8)


async def _body(pool: Pool, url: str, data: dict) -> tuple[int, bytes]:
    r = await pool.post(url, json.dumps(data).encode(), HEADERS)
    out = b"".join([c async for c in r.aiter_raw()])
    await r.aclose()
    return r.status_code, out


@pytest.fixture
def engine():
    srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_streamed_and_plain_answers_reuse_one_connection(engine):
    async def run() -> None:
        pool = _pool()
        url = url_of(engine) + "/v1/chat/completions"
        chat = {"model": "demo", "messages": [{"role": "user", "content": "one two"}]}
        code, streamed = await _body(pool, url, {**chat, "stream": True})
        assert code == 200
        assert streamed.endswith(b"data: [DONE]\n\n")
        (conn,) = next(iter(pool._idle.values()))
        code, plain = await _body(pool, url, chat)
        assert code == 200
        assert json.loads(plain)["choices"][0]["message"]["content"] == "one two"
        assert next(iter(pool._idle.values())) == [conn]
        await pool.aclose()

    asyncio.run(run())


async def _serve(answers: list[list[bytes]]) -> tuple[asyncio.Server, list[int]]:
    """A replica answering its n-th connection's request with answers[n], written piece by piece, then closing."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        accepted.append(len(accepted))
        for piece in answers[len(accepted) - 1]:
            writer.write(piece)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", free_port())
    return server, accepted


def test_chunks_split_anywhere_are_read_whole_and_a_closed_connection_is_not_reused():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
    )
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def run() -> None:
        # Byte by byte: every framing boundary falls between two reads somewhere.
        server, accepted = await _serve([[bytes([b]) for b in chunked], [plain]])
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        pool = _pool()
        assert await _body(pool, url, {}) == (200, b"hello world")
        (conn,) = next(iter(pool._idle.values()))
        while not conn.link.eof:  # the replica's close reaches the event loop
            await asyncio.sleep(0.01)
        # The closed connection is left, a new one taken: no error reaches the caller.
        assert await _body(pool, url, {}) == (200, b"ok")
        assert accepted == [0, 1]
        await pool.aclose()
        server.close()

    asyncio.run(run())


def test_refused_and_cut_off_answers_are_upstream_errors():
    async def run() -> None:
        pool = _pool()
        with pytest.raises(UpstreamError, match="ConnectionRefusedError"):
            await pool.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", HEADERS)
        server, _ = await _serve([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"]])
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        r = await pool.post(url, b"{}", HEADERS)
        with pytest.raises(UpstreamError, match="mid-answer"):
            [c async for c in r.aiter_raw()]
        await r.aclose()
        assert pool._idle.get(next(iter(pool._origins.values())), []) == []
        server.close()

    asyncio.run(run())


def test_a_replica_that_stops_sending_times_out_and_only_a_waiting_read_does():
    async def run() -> None:
        stall = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
                path = head.split(b" ")[1]
                if path == b"/v1/slow-head":
                    await stall.wait()
                elif path == b"/v1/slow-body":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
                    await stall.wait()
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
                    await writer.drain()
                    writer.write(b"-rest!")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = Pool(connect_timeout=2, read_timeout=0.3, keepalive_expiry=30, max_idle=8)
        with pytest.raises(UpstreamError) as head_late:
            await pool.post(f"{base}/v1/slow-head", b"{}", HEADERS)
        assert isinstance(head_late.value.__cause__, TimeoutError)
        r = await pool.post(f"{base}/v1/slow-body", b"{}", HEADERS)
        with pytest.raises(UpstreamError) as body_late:
            [c async for c in r.aiter_raw()]
        assert isinstance(body_late.value.__cause__, TimeoutError)
        await r.aclose()
        # Between two reads the caller may take longer than the timeout (a slow client): no read waited.
        r = await pool.post(f"{base}/v1/two-parts", b"{}", HEADERS)
        parts = r.aiter_raw()
        first = await anext(parts)
        await asyncio.sleep(0.8)
        assert first + b"".join([c async for c in parts]) == b"half-rest!"
        await r.aclose()
        # The answer read, its deadline is gone: the task waits on uncancelled.
        await asyncio.sleep(0.8)
        stall.set()
        await pool.aclose()
        server.close()

    asyncio.run(run())


async def _serve_then_drop(
    answers: dict[int, bytes], *, close_after: frozenset[int] = frozenset()
) -> tuple[asyncio.Server, list[tuple[int, int]]]:
    """A replica that keeps connections alive: request r on connection c (key c*10+r) is answered
    with answers[key], the connection closed after it when the key is in `close_after`, or closed
    unanswered when there is no answer."""
    seen: list[tuple[int, int]] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        c, connections = connections, connections + 1
        r = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            seen.append((c, r))
            answer = answers.get(c * 10 + r)
            if answer is None:
                break
            writer.write(answer)
            await writer.drain()
            if c * 10 + r in close_after:
                break
            r += 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


STREAMED = (
    b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nsse!\r\n0\r\n\r\n"
)
PLAIN = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_a_kept_alive_connection_closed_as_the_request_went_out_is_retried_once_on_a_new_one():
    # llama.cpp's server closes after a streamed answer despite its Keep-Alive head; a request
    # that catches the connection before the close reaches the gateway must not fail for it.
    async def run() -> None:
        server, seen = await _serve_then_drop({0: STREAMED, 10: PLAIN})
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        metrics = Metrics()
        pool = Pool(
            connect_timeout=2, read_timeout=5, keepalive_expiry=30, max_idle=8, on_reopen=metrics.upstream_reopened.inc
        )
        assert await _body(pool, url, {}) == (200, b"sse!")
        (conn,) = next(iter(pool._idle.values()))
        assert not conn.link.eof  # looks alive when taken: the close has not been seen
        assert await _body(pool, url, {}) == (200, b"ok")
        assert seen == [(0, 0), (0, 1), (1, 0)]
        assert pool.reopened == 1
        # What an operator sees of it: the engine's closes, counted on the gateway's /metrics.
        assert "\nllmgw_gateway_upstream_reopened_total 1.0\n" in generate_latest(metrics.registry).decode()
        await pool.aclose()
        server.close()

    asyncio.run(run())


def test_a_new_connection_closed_unanswered_is_an_error_not_retried():
    async def run() -> None:
        # Connection 0 answers once then drops the next request; connection 1 drops its first.
        server, seen = await _serve_then_drop({0: STREAMED})
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        pool = _pool()
        assert await _body(pool, url, {}) == (200, b"sse!")
        with pytest.raises(UpstreamError, match="IncompleteReadError"):
            await pool.post(url, b"{}", HEADERS)
        # Retried once on a new connection, which failed the same way: the error reaches the caller.
        assert seen == [(0, 0), (0, 1), (1, 0)]
        assert pool.reopened == 1
        with pytest.raises(UpstreamError, match="IncompleteReadError"):
            await pool.post(url, b"{}", HEADERS)
        assert seen[-1] == (2, 0)  # nothing pooled: a new connection, no second try
        assert pool.reopened == 1
        await pool.aclose()
        server.close()

    asyncio.run(run())


def test_a_partial_head_on_a_kept_alive_connection_is_not_retried():
    async def run() -> None:
        server, seen = await _serve_then_drop({0: PLAIN, 1: b"HTTP/1.1 200 O", 10: PLAIN}, close_after=frozenset({1}))
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        pool = _pool()
        assert await _body(pool, url, {}) == (200, b"ok")
        # The engine began an answer and closed: a second try could run the request twice.
        with pytest.raises(UpstreamError, match="IncompleteReadError"):
            await pool.post(url, b"{}", HEADERS)
        assert seen == [(0, 0), (0, 1)]
        assert pool.reopened == 0
        await pool.aclose()
        server.close()

    asyncio.run(run())


async def _relayed(pool: Pool, url: str) -> tuple[list[bytes], object]:
    """The parts Response.relay hands over for one answer, and what it ended with (None, or the exception)."""
    r = await pool.post(url, b"{}", HEADERS)
    parts: list[bytes] = []
    try:
        await r.relay(parts.append)
        ended = None
    except Exception as e:
        ended = e
    await r.aclose()
    return parts, ended


def test_a_relayed_body_comes_whole_in_order_whatever_its_framing_and_the_connection_is_kept():
    # Chunked and split byte by byte (every boundary between two reads somewhere), then by length.
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"

    async def run() -> None:
        split, _ = await _serve([[bytes([b]) for b in chunked]])
        pool = _pool()
        parts, ended = await _relayed(pool, f"http://127.0.0.1:{split.sockets[0].getsockname()[1]}/v1/completions")
        assert (b"".join(parts), ended) == (b"hello world", None)
        assert all(parts)
        assert len(next(iter(pool._idle.values()))) == 1  # read to its end: kept for the next request
        # The body's first bytes came with the head: handed over before anything more is read.
        whole, _ = await _serve([[STREAMED]])
        parts, ended = await _relayed(pool, f"http://127.0.0.1:{whole.sockets[0].getsockname()[1]}/v1/completions")
        assert (parts, ended) == ([b"sse!"], None)
        by_length, _ = await _serve([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", b"-rest!"]])
        parts, ended = await _relayed(pool, f"http://127.0.0.1:{by_length.sockets[0].getsockname()[1]}/v1/x")
        assert (b"".join(parts), ended) == (b"half-rest!", None)
        await pool.aclose()
        for s in (split, whole, by_length):
            s.close()

    asyncio.run(run())


def test_a_relayed_body_cut_off_or_stalled_is_an_upstream_error_and_the_connection_is_dropped():
    async def run() -> None:
        pool = Pool(connect_timeout=2, read_timeout=0.3, keepalive_expiry=30, max_idle=8)
        cut, _ = await _serve([[b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nsse!\r\n"]])
        parts, ended = await _relayed(pool, f"http://127.0.0.1:{cut.sockets[0].getsockname()[1]}/v1/x")
        assert parts == [b"sse!"]
        assert isinstance(ended, UpstreamError) and "mid-answer" in str(ended)
        stall = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nsse!\r\n")
            await writer.drain()
            await stall.wait()
            writer.close()

        stalled = await asyncio.start_server(handle, "127.0.0.1", 0)
        parts, ended = await _relayed(pool, f"http://127.0.0.1:{stalled.sockets[0].getsockname()[1]}/v1/x")
        assert parts == [b"sse!"]
        assert isinstance(ended, UpstreamError) and isinstance(ended.__cause__, TimeoutError)
        # Neither answer was read to its end: no connection kept, and the timer of each gone.
        assert all(idle == [] for idle in pool._idle.values())
        stall.set()
        await pool.aclose()
        cut.close()
        stalled.close()

    asyncio.run(run())


def test_a_failure_of_the_relays_receiver_ends_the_relay_with_it():
    async def run() -> None:
        server, _ = await _serve([[STREAMED]])
        pool = _pool()
        r = await pool.post(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/x", b"{}", HEADERS)

        def refuse(part: bytes) -> None:
            raise LookupError(part)

        with pytest.raises(LookupError, match="sse!"):
            await r.relay(refuse)
        await r.aclose()
        assert all(idle == [] for idle in pool._idle.values())
        await pool.aclose()
        server.close()

    asyncio.run(run())


def test_a_connection_kept_after_an_answer_that_ended_paused_reads_the_next_answer():
    # The relay holds the replica while its client is behind; an answer whose last part did so
    # must not go back to the pool with its reading still held.
    async def run() -> None:
        server, seen = await _serve_then_drop({0: STREAMED, 1: PLAIN})
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        pool = Pool(connect_timeout=2, read_timeout=2, keepalive_expiry=30, max_idle=8)
        r = await pool.post(url, b"{}", HEADERS)
        parts: list[bytes] = []

        def behind(part: bytes) -> None:
            parts.append(part)
            r.pause()

        await r.relay(behind)
        await r.aclose()
        assert parts == [b"sse!"]
        assert await _body(pool, url, {}) == (200, b"ok")
        assert seen == [(0, 0), (0, 1)]
        await pool.aclose()
        server.close()

    asyncio.run(run())
