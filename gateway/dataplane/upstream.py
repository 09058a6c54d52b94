"""Choosing a replica, sending it the request, retrying once before the first byte, ejecting one that keeps failing."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from django.conf import settings

from gateway import routing
from gateway.dataplane.http import Native, Receive, Send, error_body, send_raw
from gateway.dataplane.metrics import Metrics
from gateway.dataplane.pool import Pool, UpstreamError
from gateway.dataplane.streaming import Ask, Outcome
from gateway.table import Backend, ModelRoute

log = logging.getLogger("gateway.dataplane")

HEADERS = b"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
# The routes whose streams can carry a usage chunk (stream_options.include_usage).
USAGE_STREAMS = frozenset({"/v1/chat/completions", "/v1/completions"})


def failure(e: UpstreamError | None, status: int = 0) -> tuple[str, str]:
    """A replica's failure as a metric's kind and the words a client reads (never an address or exception text)."""
    if status:
        return "http_5xx", f"answered with an error (HTTP {status})"
    cause = e.__cause__ if e is not None else None
    if isinstance(cause, TimeoutError):
        return "timeout", "did not answer in time"
    if isinstance(cause, ConnectionRefusedError):
        return "refused", "could not be reached (connection refused)"
    if isinstance(cause, OSError | EOFError):
        return "connection", "closed the connection before answering"
    return "protocol", "did not answer in HTTP"


@dataclass
class Health:
    """A replica's recent failures as this process saw them."""

    failures: int = 0
    ejected_until: float = 0.0


class Upstream:
    """The data plane's forwarding half. Its state (client, health, in-flight counts) is the DataPlane's."""

    pool: Pool
    health: dict[str, Health]
    inflight: dict[str, int]
    metrics: Metrics
    round_robin: bool
    prefixes: routing.PrefixIndex
    turn: int
    # Holder's: wait for a replica of a model at zero (gateway/dataplane/hold.py).
    hold: Callable[[ModelRoute], Awaitable[tuple[ModelRoute | None, str]]]

    def _ejected(self, now: float) -> set[str]:
        return {rid for rid, h in self.health.items() if h.ejected_until > now}

    def _failed(self, backend: Backend) -> None:
        h = self.health[backend.id]
        h.failures += 1
        if h.failures >= settings.LLMGW_GATEWAY_EJECT_AFTER and h.ejected_until <= time.monotonic():
            h.ejected_until = time.monotonic() + settings.LLMGW_GATEWAY_EJECT_FOR
            self.metrics.ejected.labels(backend.id).set(1)
            log.warning("gateway: replica %s ejected after %d failures in a row", backend.id, h.failures)

    def _succeeded(self, backend: Backend) -> None:
        h = self.health.get(backend.id)
        if h is not None and h.failures:
            h.failures = 0
            if h.ejected_until:
                h.ejected_until = 0.0
                self.metrics.ejected.labels(backend.id).set(0)

    async def _forward(
        self,
        receive: Receive,
        send: Send,
        route: ModelRoute,
        body: dict,
        raw: bytes,
        path: str,
        started: float,
        settle: Callable[[Outcome], Awaitable[None]] | None = None,
        rid: bytes = b"-",
        native: Native | None = None,
    ) -> Outcome:
        """Send the request to a replica, once more to another on a failure before the first byte, and relay.

        `native`: the native server's ways past ASGI, under it (Relay._relay).
        """
        if not route.backends and route.hold:
            waited = time.monotonic()
            found, why = await self.hold(route)
            self.metrics.hold_seconds.labels(route.name, "routed" if found else "refused").observe(
                time.monotonic() - waited
            )
            if found is None:
                await send_raw(
                    send,
                    503,
                    error_body(503, why, "service_unavailable", "no_ready_replica"),
                    [(b"retry-after", b"10")],
                )
                return Outcome(code=503, error=True)
            route = found
        ask = Ask(route.name, path)
        if body.get("stream") and path in USAGE_STREAMS:
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                # The usage of a stream is counted from the engine's own last chunk, which the
                # client, not having asked, does not get.
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                raw = json.dumps(body).encode()
                ask = Ask(route.name, path, strip_usage=True)
        headers = HEADERS + b"X-Request-Id: " + rid + b"\r\n"
        hashes = () if self.round_robin else routing.block_hashes(body)
        start = b"" if self.round_robin else routing.conversation_start(body)
        tried: set[str] = set()
        # The last failure: its metric kind and its words for the client; each one's detail for the log.
        last = ("", "")
        details: list[str] = []
        # A replica whose connection failed before any answer, to be asked again if no other is left.
        again: Backend | None = None
        for attempt in range(2):
            now = time.monotonic()
            if self.round_robin:
                self.turn += 1
                backend = routing.round_robin(route.backends, self.turn, exclude=tried | self._ejected(now))
            else:
                backend = routing.choose(
                    route.backends,
                    hashes=hashes,
                    start=start,
                    load=self.loads(route.backends),
                    index=self.prefixes,
                    exclude=tried | self._ejected(now),
                )
                if backend is not None:
                    # Recorded as sent at once, so that the sessions arriving next with the same
                    # system prompt follow this one rather than each warm a replica of its own.
                    self.prefixes.admit(backend.id, hashes)
            # A connection that failed before any answer is most often the connection's fault (a
            # full accept queue, a reset), not the replica's: with one replica, not asking it again
            # made every such blip a 502 under load. (A kept-alive connection the engine closed is
            # the pool's to mend: it sends the request again on a new one before this sees it.)
            backend = backend or again
            if backend is None:
                break
            tried.add(backend.id)
            self.inflight[backend.id] += 1
            try:
                try:
                    response = await self.pool.post(backend.endpoint + path, raw, headers)
                except UpstreamError as e:
                    self._failed(backend)
                    again = backend if backend.id not in self._ejected(time.monotonic()) else None
                    last = failure(e)
                    details.append(f"replica {backend.id} at {backend.endpoint}: {e}")
                    self.metrics.upstream_failures.labels(route.name, last[0]).inc()
                    self.metrics.retries.inc(1 - attempt)
                    continue
                if response.status_code >= 500:
                    await response.aclose()
                    again = None
                    self._failed(backend)
                    last = failure(None, response.status_code)
                    details.append(f"replica {backend.id} at {backend.endpoint}: HTTP {response.status_code}")
                    self.metrics.upstream_failures.labels(route.name, last[0]).inc()
                    self.metrics.retries.inc(1 - attempt)
                    continue
                self._succeeded(backend)
                return await self._relay(receive, send, response, backend, started, settle, ask, native)
            finally:
                self.inflight[backend.id] -= 1
                if not self.inflight[backend.id]:
                    del self.inflight[backend.id]
        if not tried:
            retry = "5"
            message = route.unavailable_reason()
            if route.backends:
                message += f" ({len(route.backends)} ejected after repeated failures)"
            await send_raw(
                send,
                503,
                error_body(503, message, "service_unavailable", "no_ready_replica"),
                [(b"retry-after", retry.encode())],
            )
            return Outcome(code=503, error=True)
        # The detail (addresses, the exception) goes to the log under the request's id; the client reads words.
        log.warning("gateway: request %s for %s failed: %s", rid.decode(), route.name, "; ".join(details))
        kind, words = last
        if kind == "timeout":
            status, code = 504, "upstream_timeout"
        else:
            status, code = 502, "upstream_failed"
        await send_raw(
            send, status, error_body(status, f"the replica of model {route.name!r} {words}", "upstream_error", code)
        )
        return Outcome(code=status, error=True)
