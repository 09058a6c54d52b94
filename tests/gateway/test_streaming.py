"""Reading an answer's usage on its way to the client; holding the replica while the client is behind."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from gateway.dataplane.pool import Pool
from gateway.dataplane.streaming import Ask, Outcome, Relay
from gateway.table import Backend
from tests.gateway.conftest import wait_for
from tests.gateway.test_native_server import Served, answers


def _scan(lines: list[dict | str]) -> Outcome:
    out = Outcome()
    data = b"".join(
        b"data: " + (json.dumps(x).encode() if isinstance(x, dict) else x.encode()) + b"\n\n" for x in lines
    )
    rest = b""
    for i in range(0, len(data), 5):  # in small reads, lines split across them
        rest = Relay()._scan_sse(rest + data[i : i + 5], out)
    return out


def test_a_chat_streams_usage_chunk_is_read():
    out = _scan(
        [
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}},
            "[DONE]",
        ]
    )
    assert (out.prompt_tokens, out.completion_tokens) == (7, 2)


def test_the_responses_apis_usage_is_read_from_its_completed_event():
    usage = {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8}
    out = _scan(
        [
            {"type": "response.created", "response": {"id": "resp_1", "usage": None}},
            {"type": "response.output_text.delta", "delta": "a"},
            {"type": "response.completed", "response": {"id": "resp_1", "usage": usage}},
        ]
    )
    assert (out.prompt_tokens, out.completion_tokens) == (5, 3)


# A streamed answer larger than every buffer between the replica and a client that does not read.
STREAM_PARTS = 512
PART = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"


class _Replica:
    """A replica streaming STREAM_PARTS events of 64 KiB (chunked) to each request, on a loop in a thread."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        self.ready.set()
        await self.stop.wait()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(STREAM_PARTS):
            writer.write(b"%x\r\n%b\r\n" % (len(PART), PART))
            await writer.drain()
            self.sent += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.done.set()
        writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def test_on_the_native_server_a_client_behind_holds_the_replica_and_then_gets_every_byte():
    # The relay writes from the replica's read callback: a client that does not read must stop
    # the replica being read, or the gateway would hold the whole answer in memory.
    replica = _Replica()
    links: list = []
    outcomes: list[Outcome] = []
    pool = Pool(connect_timeout=2, read_timeout=30, keepalive_expiry=30, max_idle=8)
    backend = Backend(id="r1", endpoint=replica.url, engine="echo", engine_version="", deployment="demo")

    async def application(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        response = await pool.post(replica.url, b"{}", b"")
        links.append(response._conn.link)
        native = scope["extensions"]["llmgw.native"]
        outcomes.append(await Relay()._relay(receive, send, response, backend, 0.0, None, Ask("demo", "/x"), native))

    served = Served(application=application)
    try:
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            c.connect(("127.0.0.1", served.port))
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            # Not read: the gateway's writes to it back up, and the replica's connection stops being read.
            (conn,) = wait_for(lambda: [x for x in served.server.connections if x.writing_paused], timeout=10)
            link = wait_for(lambda: links and links[0], timeout=10)
            wait_for(lambda: not link.transport.is_reading(), timeout=10, what="the replica's reading paused")
            assert not replica.done.is_set()
            assert replica.sent < STREAM_PARTS
            raw = b""
            c.settimeout(10)
            while not raw.endswith(b"\r\n0\r\n\r\n"):
                raw += c.recv(1 << 20)
        status, headers, body = answers(raw)[0]
        assert (status, headers["content-type"], headers["x-llmgw-replica"]) == (200, "text/event-stream", "r1")
        assert body == PART * STREAM_PARTS
        assert replica.done.is_set()
        assert [(o.code, o.error) for o in outcomes] == [(200, False)]
        assert conn.drain_hooks == []
    finally:
        served.close()
        replica.close()
