"""Relaying a replica's answer to the client as it arrives, and reading the engine's usage from it on the way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.dataplane.http import ClientGone, Native, Receive, Send, engine_error, error_body, send_raw
from gateway.dataplane.pool import Response, UpstreamError
from gateway.dataplane.sse import UsageStripper
from gateway.table import Backend

# The most of an engine's error answer read to rewrite it in OpenAI's shape.
ERROR_BODY_LIMIT = 1024 * 1024


@dataclass(frozen=True)
class Ask:
    """What the relay must know of the request it answers."""

    model: str
    path: str
    # The client did not ask for a stream's usage: the gateway did, and takes it out again.
    strip_usage: bool = False


@dataclass
class Outcome:
    """What one proxied request came to, for metrics, limits and usage."""

    code: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    error: bool = False
    # Called once the usage is known and before the answer's end reaches the
    # client, so a client's next request sees this one's tokens counted.
    settle: Callable[[Outcome], Awaitable[None]] | None = None
    settled: bool = False

    async def settle_once(self) -> None:
        """Run `settle` if it has not run yet."""
        if self.settle is not None and not self.settled:
            self.settled = True
            await self.settle(self)


class _Watch:
    """Cancels a request's task once its client has gone, unless the relay it watches is over."""

    __slots__ = ("cancelled", "over", "task")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.over = False
        self.cancelled = False

    def gone(self) -> None:
        """The client's connection is lost."""
        if not self.over and not self.cancelled:
            self.cancelled = True
            self.task.cancel()

    def watched(self, watcher: asyncio.Future) -> None:
        """The task waiting on `receive` has ended: the client has gone, unless it was cancelled."""
        if not watcher.cancelled():
            self.gone()


class Relay:
    """The data plane's relaying half: one answer passed through, cancelled with its client."""

    async def _relay(
        self,
        receive: Receive,
        send: Send,
        response: Response,
        backend: Backend,
        started: float,
        settle: Callable[[Outcome], Awaitable[None]] | None,
        ask: Ask,
        native: Native | None = None,
    ) -> Outcome:
        """Pass the replica's answer through as it arrives; stop at once when the client goes away.

        `native`: the native server's ways past ASGI (its "llmgw.native"
        extension): hooks called when the client's connection is lost, and a
        stream's parts written from the replica's read callback. Without it the
        client is watched by a task waiting on `receive` for http.disconnect.
        """
        out = Outcome(code=response.status_code, error=response.status_code >= 400, settle=settle)
        if response.status_code >= 400:
            pump = self._refusal(send, response, backend, out, started, ask)
        else:
            pump = self._pump(send, response, backend, out, started, ask, native)
        lost = native.lost_hooks if native is not None else None
        # The relay runs in the request's own task, which a client gone cancels: a task for the
        # relay and a wait on two tasks were a third of the loop's turns a request took.
        watch = _Watch(asyncio.current_task())
        watcher: asyncio.Future | None = None
        if lost is not None:
            lost.append(watch.gone)
        else:
            watcher = asyncio.ensure_future(self._wait_disconnect(receive))
            watcher.add_done_callback(watch.watched)
        try:
            await pump
        except asyncio.CancelledError:
            if not watch.cancelled:
                raise
            watch.task.uncancel()
            out.error = True
            out.code = 499
        except ClientGone:
            pass
        finally:
            watch.over = True
            if lost is not None:
                with contextlib.suppress(ValueError):
                    lost.remove(watch.gone)
            if watcher is not None:
                watcher.cancel()
            # Closing the stream closes the upstream connection: the engine sees the client gone.
            await response.aclose()
        return out

    async def _wait_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _refusal(
        self, send: Send, response: Response, backend: Backend, out: Outcome, started: float, ask: Ask
    ) -> None:
        """An engine's error answer, rewritten in OpenAI's shape; a route it does not serve named as such."""
        raw = b""
        with contextlib.suppress(UpstreamError):
            async for chunk in response.aiter_raw():
                if out.ttft is None:
                    out.ttft = time.monotonic() - started
                raw += chunk
                if len(raw) > ERROR_BODY_LIMIT:
                    break
        if response.status_code == 404 and not _names_model(raw):
            # vLLM (FastAPI) and the echo engine answer a route they lack with a bare 404.
            body = error_body(
                404,
                f"the {backend.engine} engine of model {ask.model!r} does not serve POST {ask.path}",
                "invalid_request_error",
                "unsupported_route",
            )
        else:
            body = engine_error(response.status_code, raw)
        await out.settle_once()
        try:
            await send_raw(send, response.status_code, body, [(b"x-llmgw-replica", backend.id.encode())])
        except Exception as e:
            raise ClientGone from e

    async def _pump(
        self, send: Send, response: Response, backend: Backend, out: Outcome, started: float, ask: Ask,
        native: Native | None,
    ) -> None:  # fmt: skip
        headers = [(b"x-llmgw-replica", backend.id.encode())]
        ctype = response.headers.get("content-type", "application/json")
        headers.append((b"content-type", ctype.encode()))
        sse = ctype.startswith("text/event-stream")
        if not sse:
            await self._whole(send, response, headers, out, started)
            return
        headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        strip = UsageStripper() if ask.strip_usage else None
        part_of = self._parts(out, started, strip)
        if native is not None:
            # Each part written from the replica's read callback, no task step: a client behind
            # reading holds the replica until it has caught up.
            def passed(chunk: bytes) -> None:
                if (part := part_of(chunk)) and native.write_body(part):
                    response.pause()
                    native.when_drained(response.resume)

            await response.relay(passed)
        else:
            async for chunk in response.aiter_raw():
                if part := part_of(chunk):
                    try:
                        await send({"type": "http.response.body", "body": part, "more_body": True})
                    except Exception as e:
                        raise ClientGone from e
        rest = b""
        if strip is not None:
            # The stripper parsed every usage line it took out (chat and text completions' streams).
            rest = strip.end()
            self._take_usage(strip.usage, out)
        await out.settle_once()
        await send({"type": "http.response.body", "body": rest, "more_body": False})

    def _parts(self, out: Outcome, started: float, strip: UsageStripper | None) -> Callable[[bytes], bytes]:
        """What of each read of a stream goes to the client; the time to its first byte and its usage noted."""
        tail = b""

        def part_of(chunk: bytes) -> bytes:
            nonlocal tail
            if out.ttft is None:
                out.ttft = time.monotonic() - started
            if strip is not None:
                return strip.feed(chunk)
            tail = self._scan_sse(tail + chunk, out)
            return chunk

        return part_of

    async def _whole(
        self, send: Send, response: Response, headers: list[tuple[bytes, bytes]], out: Outcome, started: float
    ) -> None:
        """An answer that is not a stream, sent whole with its length: one write to the client, not one per read.

        The client can use none of it before its end (a JSON document), so
        holding it costs no latency, and its usage is read from it on the way.
        """
        parts: list[bytes] = []
        async for chunk in response.aiter_raw():
            if out.ttft is None:
                out.ttft = time.monotonic() - started
            parts.append(chunk)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if body:
            with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError, TypeError):
                self._take_usage(json.loads(body).get("usage"), out)
        await out.settle_once()
        headers.append((b"content-length", b"%d" % len(body)))
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        except Exception as e:
            raise ClientGone from e

    def _scan_sse(self, buf: bytes, out: Outcome) -> bytes:
        """Read usage from complete `data:` lines; return the incomplete rest."""
        if b'"usage"' not in buf:
            # Most reads carry no usage: only the unfinished last line is kept.
            return buf[buf.rfind(b"\n") + 1 :]
        *lines, rest = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
                    event = json.loads(line[6:])
                    # The Responses API's stream carries its usage in the last event's response.
                    if event.get("type") == "response.completed":
                        event = event.get("response") or {}
                    self._take_usage(event.get("usage"), out)
        return rest

    @staticmethod
    def _take_usage(u: Any, out: Outcome) -> None:
        if isinstance(u, dict):
            # Chat, completions and embeddings say prompt/completion; the Responses API input/output.
            out.prompt_tokens = int(u.get("prompt_tokens") or u.get("input_tokens") or 0)
            out.completion_tokens = int(u.get("completion_tokens") or u.get("output_tokens") or 0)


def _names_model(raw: bytes) -> bool:
    """Whether an engine's 404 is about the model (it serves the route), not the route."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    err = data.get("error", data) if isinstance(data, dict) else None
    return isinstance(err, dict) and (err.get("param") == "model" or err.get("code") == "model_not_found")
