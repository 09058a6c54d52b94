"""The ASGI plumbing the data plane's modules share: the callables' types, OpenAI-style errors, plain answers."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client closed its connection while we were answering."""


def error_body(status: int, message: str, kind: str, code: str, param: str | None = None) -> bytes:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def send_raw(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with a complete JSON body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, data: Any) -> None:
    """Answer with `data` as JSON."""
    await send_raw(send, status, json.dumps(data).encode())
