"""A body deadline under gunicorn: a trickled body is cut off with a 408, its thread freed within the deadline.

gunicorn's gthread workers give a connection to a thread once its first
bytes have come, and the application's read of the body then blocks that
thread for as long as the client takes: a client sending a byte every few
seconds held it without end. A WSGI middleware cannot move the read off
the thread (granian's front, llmgw/front.py, does: that is why granian is
the default), but it can bound it: every recv() of the body is given the
socket timeout of what is left of LLMGW_BODY_TIMEOUT, counted from when
the headers were in, so the whole body has that long, not each byte (a
socket timeout alone bounds one recv(), which a byte at a time never
meets). When it runs out the read fails, and whatever the application made
of that is replaced by a 408 that closes the connection.

The bound is per request: a thread is held at most LLMGW_BODY_TIMEOUT, and
as many trickling clients as there are threads still hold them all for that
long. gunicorn in production therefore still belongs behind a proxy that
buffers request bodies (docs/security.md).

Only requests that come with gunicorn's socket (`gunicorn.socket` in the
environ) are touched; under granian the body is already whole in memory.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

WSGIApp = Callable[[dict, Callable], Iterable[bytes]]


class BodyTimeout(OSError):
    """The request's body did not arrive within its deadline."""


class _DeadlineSocket:
    """gunicorn's connection socket, as its body reader sees it: every recv() ends by `deadline`.

    A socket timeout bounds one recv(), and a client sending a byte per recv
    never meets it; given what is left of the deadline before each recv(),
    the whole body is bounded.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def recv(self, size: int) -> bytes:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the body did not arrive within its deadline")
        self.sock.settimeout(remaining)
        try:
            return self.sock.recv(size)
        finally:
            self.sock.settimeout(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class DeadlineInput:
    """gunicorn's `wsgi.input`, read from the socket within `deadline` (time.monotonic()); `expired` once missed."""

    def __init__(self, raw: Any, deadline: float) -> None:
        self.raw = raw
        self.expired = False
        # gunicorn's Body -> its reader (length or chunked) -> the connection's unreader -> the socket.
        self._unreader = getattr(getattr(raw, "reader", None), "unreader", None)
        self._sock = getattr(self._unreader, "sock", None)
        if self._sock is not None:
            self._unreader.sock = _DeadlineSocket(self._sock, deadline)

    def restore(self) -> None:
        """The connection's own socket back to its reader (the next request on it has a deadline of its own)."""
        if self._sock is not None:
            self._unreader.sock = self._sock

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except TimeoutError:
            self.expired = True
            raise BodyTimeout("the body did not arrive within its deadline") from None

    def read(self, size: int | None = None) -> bytes:
        """As `wsgi.input.read`, within the deadline."""
        return self._call(self.raw.read, size)

    def readline(self, size: int | None = None) -> bytes:
        """As `wsgi.input.readline`, within the deadline."""
        return self._call(self.raw.readline, size)

    def readlines(self, hint: int | None = None) -> list[bytes]:
        """As `wsgi.input.readlines`, within the deadline."""
        return self._call(self.raw.readlines, hint)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line


def _no_write(data: bytes) -> None:
    # The answer waits until the body's fate is known; Django never writes through start_response's write().
    raise RuntimeError("start_response's write() is not supported behind the body deadline")


def with_body_deadline(application: WSGIApp, *, timeout_s: float) -> WSGIApp:
    """`application` with each gunicorn request's body read within `timeout_s` seconds (then a 408)."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("gunicorn.socket") is None:
            return application(environ, start_response)
        body = DeadlineInput(environ["wsgi.input"], time.monotonic() + timeout_s)
        environ["wsgi.input"] = body
        started: list[tuple] = []

        def held_start(status: str, headers: list, exc_info: Any = None) -> Callable:
            started[:] = [(status, headers, exc_info)]
            return _no_write

        try:
            result = application(environ, held_start)
        finally:
            body.restore()
        if body.expired:
            if hasattr(result, "close"):
                result.close()
            detail = f'{{"detail": "the body did not arrive within {timeout_s:g} s", "errors": []}}'.encode()
            start_response(
                "408 Request Timeout",
                [("Content-Type", "application/json"), ("Content-Length", str(len(detail))), ("Connection", "close")],
            )
            return [detail]
        if not started:
            raise RuntimeError("the application returned before start_response: not supported behind the deadline")
        status, headers, exc_info = started[0]
        start_response(status, headers, exc_info)
        return result

    app.__wrapped__ = application  # type: ignore[attr-defined]
    return app
