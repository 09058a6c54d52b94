"""The ASGI plumbing the data plane's modules share: the callables' types, request ids, OpenAI-style errors."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# A client's own request id is echoed only when it cannot break a header or a log line.
SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
# An engine's error code is a number (vLLM: the HTTP status); OpenAI's SDKs expect a string.
STATUS_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
}
# Text that says an engine's message is a program's insides (a traceback, an exception's repr,
# an address), not words for the client.
INSIDES = re.compile(
    r"Traceback \(most recent call last\)|File \"/|\b\w+(Error|Exception)\("
    r"|\b\d{1,3}(\.\d{1,3}){3}\b|localhost|\[::1?\]"
)


class Native(Protocol):
    """What the native server (gateway/dataplane/server.py) offers a request past ASGI: its "llmgw.native" extension."""

    # Called as the client's connection is lost, before any task runs again.
    lost_hooks: list[Callable[[], None]]

    def write_body(self, data: bytes) -> bool:
        """A part of the answer's body written at once, its start sent before; True while the client is behind."""

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the client has read what was written, or has gone."""


class ClientGone(Exception):
    """The client closed its connection while we were answering."""


def json_kind(value: object) -> str:
    """A JSON value's kind in JSON's words ("an array", "a number"), for an error that names it."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    return "null"


def request_id(scope: Scope) -> bytes:
    """The client's x-request-id when it sent a sane one, else a new one."""
    for k, v in scope["headers"]:
        if k == b"x-request-id":
            if SANE_REQUEST_ID.fullmatch(v):
                return v
            break
    return uuid.uuid4().hex.encode()


def stamped(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """`send`, adding `headers` to the answer's start (the list may still grow until the answer starts)."""

    async def send_stamped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return send_stamped


def error_body(status: int, message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, the code a string or null."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def engine_error(status: int, raw: bytes) -> bytes:
    """An engine's error answer in OpenAI's shape, whatever shape it came in (vLLM's, its older flat one, FastAPI's).

    A string code is kept; a numeric one becomes the status's name. A message that
    reads like a program's insides (a traceback, an exception's repr) is replaced
    by words: what the client sees must not be the engine's internals.
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        err = data if isinstance(data, dict) else {}
    message = err.get("message")
    if not isinstance(message, str) and isinstance(err.get("detail"), str):
        message = err["detail"]
    if not isinstance(message, str) or not message.strip() or INSIDES.search(message):
        message = f"the engine refused the request (HTTP {status})"
    code = err.get("code")
    if not isinstance(code, str):
        code = STATUS_CODES.get(status, "engine_error")
    kind = err.get("type")
    if not isinstance(kind, str) or not kind:
        kind = "invalid_request_error"
    param = err.get("param") if isinstance(err.get("param"), str) else None
    return error_body(status, message[:2000], kind, code, param)


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
