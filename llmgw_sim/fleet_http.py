"""The fleet's HTTP/1.1 client on asyncio streams: a few keep-alive connections shared by thousands of virtual nodes.

httpx's AsyncClient cost the fleet about 2.5 ms of CPU a request, as much as
the control plane spent answering it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class TransportError(Exception):
    """The control plane did not answer (refused, reset, timed out, or an answer that is not HTTP)."""


@dataclass
class Answer:
    """An HTTP answer: its status and body."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.content)


class Connection:
    """One keep-alive HTTP/1.1 connection to the control plane, opened on first use and after a failure.

    Only what the agent endpoints need: POST with a JSON body, answers with
    Content-Length or chunked. One request at a time (the fleet hands each
    connection to one node at a time).
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        self.authority = parts.netloc
        self.timeout_s = timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, token: str) -> Answer:
        """POST `body` to `path`; raises TransportError when no answer comes."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._post(path, body, token)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            self.close()
            raise TransportError(f"{self.authority}{path}: {type(e).__name__}: {e}") from e

    async def _post(self, path: str, body: bytes, token: str) -> Answer:
        if self.writer is None:
            ctx = ssl.create_default_context() if self.https else None
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, ssl=ctx)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get("transfer-encoding") == "chunked":
            content = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                content += chunk[:-2]
        else:
            content = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        return Answer(status, content)

    def close(self) -> None:
        """Drop the connection; the next request opens a new one."""
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
