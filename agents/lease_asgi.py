"""POST /api/v1/agent/lease in the gateway's ASGI process: renewals gathered and written in batches.

A lease is "this node is alive, and has applied these commands": at ten
thousand nodes renewing every 5 s, 2,000 a second. Through Django's request
cycle and the web server (agents/lease.py) a renewal costs about half a
millisecond of CPU, most of it the cycle, not the renewal. Here the same
message is answered by a small ASGI handler beside the agents' long-poll
(agents/wakeup.py, mounted in front of the gateway's data plane by
`with_agent_lease`, gateway/asgi.py): it reads the body on the event loop, and hands the
lease to the writer, which gathers every lease that arrives within
LLMGW_LEASE_BATCH_S (20 ms) and writes them all with one statement
(inventory/lease.py renew_batch) in one thread of its own. Each request is
answered once its batch is written, from what the statement returned.

The guarantees of the Django endpoint, kept:

- A node writes only its own lease: the batch statement joins each lease to
  its node's credential (current or previous hash), so a credential of
  another node, an unknown one, or one revoked a moment ago renews nothing
  and acknowledges nothing. No copy of the credentials is kept in memory:
  a revocation takes effect at the next batch, not after a refresh. The
  refusals come in the order of every agent endpoint (401, then the body's
  415/413/400, then 403), told apart by a lookup only when one is due.
- Commands waiting are announced: the statement says which renewed nodes
  have some, one more statement takes theirs for all of them at once
  (inventory/lease.py take_waiting_batch), and their answers carry them
  (agents/lease.py lease_answer, the same answer the Django endpoint gives);
  acks ride in the batch statement.
- An unreachable or lost node comes back to ready with its event
  (inventory/lease.py, as for a single renewal).
- Nothing is lost if the process dies: a lease is answered only after its
  batch is written (asynchronous commit, like every lease and heartbeat),
  so an agent whose answer never came sends it again, to the Django
  endpoint: a lease not written is a lease renewed late, by at most the
  window and the agent's retry, against a lost_after of many intervals.

The agent learns where this endpoint is from the control plane's
`lease_url` (LLMGW_LEASE_URL; llmgw_wire/register.py) and falls back to
the Django endpoint when it is absent or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.db import connection
from django.utils import timezone

import llmgw_wire as wire
from agents import credentials, protocol
from agents.api import check_envelope, parse_message
from agents.lease import MAX_LEASE_BODY, TABLES, asks_status, lease_answer
from agents.wakeup import ASGIApp, Receive, Scope, Send, _answer, _authenticate, mount_path
from inventory import lease as lease_db

log = logging.getLogger(__name__)

LEASE_PATH = wire.LEASE_PATH
# Leases in one statement at most: a burst larger than this is written in several.
MAX_BATCH = 1000


# The answer for a lease whose node's row another transaction held: it goes into the next batch.
BUSY = object()


def write_batch(asks: Sequence[lease_db.Ask]) -> dict[str, wire.LeaseResponse | object]:
    """Renew a batch of leases and build each renewed node's answer (in the writer's thread); by node id.

    A node missing from the answer renewed nothing: its credential is not its own.
    A node whose row was held by another transaction answers BUSY (renewed nothing yet).
    """
    now = timezone.now()
    try:
        busy: set[str] = set()
        renewals = lease_db.renew_batch(TABLES, asks, now=now, busy=busy)
        by_node = {a.node_id: a for a in asks}
        # The status floors, each checked against the status held; of the other leases, those that
        # check their node's last status is kept (one in STATUS_CHECK_EVERY). A round trip each, for all.
        floors = {n: d for n in renewals if (d := by_node[n].status_digest) is not None}
        gone = lease_db.confirm_statuses(floors)
        gone |= lease_db.keep_statuses([n for n in renewals if n not in floors and asks_status()])
        # The commands of every renewed node that has some, in one statement too.
        waiting = [n for n, r in renewals.items() if r.waiting]
        taken = lease_db.take_waiting_batch(TABLES, waiting, now=now, limit=wire.MAX_COMMANDS)
        answers: dict[str, wire.LeaseResponse | object] = {
            node_id: lease_answer(
                r,
                token_hash=by_node[node_id].token_hash,
                now=now,
                want_status=node_id in gone,
                taken=taken.get(node_id, ([], False)),
                floor=node_id in floors,
            )
            for node_id, r in renewals.items()
        }
        answers.update(dict.fromkeys(busy, BUSY))
        return answers
    except Exception:
        # The next batch starts on a fresh connection rather than one in an unknown state.
        with contextlib.suppress(Exception):
            connection.close()
        raise


def _close_connection() -> None:
    # django.db.connection is the calling thread's own: this closes the writer's.
    connection.close()


class LeaseWriter:
    """The batches: leases gathered for `window_s` after the first, written together in one thread.

    One batch is written at a time; leases that arrive meanwhile make the
    next. A node's second lease within one window (an agent that retried)
    waits for the next batch, since a batch renews each node once.
    """

    def __init__(
        self, *, window_s: float, max_batch: int = MAX_BATCH, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.window_s = window_s
        self.max_batch = max_batch
        # One thread, one database connection: batches never wait on each other's locks.
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-lease-db")
        self.pending: dict[str, tuple[lease_db.Ask, asyncio.Future]] = {}
        self.later: list[tuple[lease_db.Ask, asyncio.Future]] = []
        # When (monotonic) the oldest pending lease arrived.
        self.first_at = 0.0
        self.batches = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def _add(self, ask: lease_db.Ask, future: asyncio.Future) -> None:
        if ask.node_id in self.pending or len(self.pending) >= self.max_batch:
            self.later.append((ask, future))
            return
        if not self.pending:
            self.first_at = time.monotonic()
        self.pending[ask.node_id] = (ask, future)

    async def renew(self, ask: lease_db.Ask) -> wire.LeaseResponse | None:
        """The lease's answer once its batch is written; None when its credential is not its node's."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            # (Again, should the writer ever have stopped: no lease waits on a writer that is gone.)
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        future: asyncio.Future[wire.LeaseResponse | None] = loop.create_future()
        self._add(ask, future)
        assert self._wake is not None
        self._wake.set()
        return await future

    def _take(self) -> list[tuple[lease_db.Ask, asyncio.Future]]:
        batch = list(self.pending.values())
        self.pending = {}
        later, self.later = self.later, []
        for ask, future in later:
            if not future.done():
                self._add(ask, future)
        return batch

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            wait = self.first_at + self.window_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            batch = self._take()
            if not self.pending:
                self._wake.clear()
            live = [(a, f) for a, f in batch if not f.done()]
            if not live:
                continue
            try:
                answers = await loop.run_in_executor(self.executor, write_batch, [a for a, _ in live])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # The database did not answer: these requests fail (503) and their agents send again.
                log.warning("agent lease: a batch of %d leases was not written (%s)", len(live), type(e).__name__)
                for _, f in live:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.batches += 1
            for ask, f in live:
                if f.done():
                    continue
                answer = answers.get(ask.node_id)
                if answer is BUSY:
                    # Its row was held: the next batch tries again (a lease renewed a few ms late).
                    self._add(ask, f)
                    self._wake.set()
                else:
                    f.set_result(answer)

    async def close(self) -> None:
        """Stop the writer (what is pending is not written: its requests are cancelled)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for _, f in [*self.pending.values(), *self.later]:
            f.cancel()
        self.pending, self.later = {}, []
        # The thread's database connection goes with it.
        await asyncio.get_running_loop().run_in_executor(self.executor, _close_connection)
        self.executor.shutdown(wait=True)


class LeaseEndpoint:
    """The ASGI application answering POST /api/v1/agent/lease with batched renewals."""

    def __init__(self, *, window_s: float | None = None, writer: LeaseWriter | None = None) -> None:
        self.writer = writer or LeaseWriter(window_s=settings.LLMGW_LEASE_BATCH_S if window_s is None else window_s)
        self.body_timeout = settings.LLMGW_BODY_TIMEOUT
        # Refusals only (which one is due): a lookup each, in threads of their own.
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent-lease-auth")

    async def close(self) -> None:
        """Stop writing (a server shutting down, a test ending)."""
        await self.writer.close()
        self._lookups.shutdown(wait=True)

    async def _owner(self, token: str) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(self._lookups, _authenticate, token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await _answer(send, 405, {"detail": f'method "{scope["method"]}" not allowed', "errors": []},
                          [(b"allow", b"POST")])  # fmt: skip
            return
        headers = _headers(scope)
        token = credentials.bearer(headers.get(b"authorization"))
        if token is None or not token.startswith(credentials.NODE_PREFIX):
            await _refuse(send, protocol.UNAUTHENTICATED)
            return
        try:
            msg = await self._read(headers, receive)
        except TimeoutError:
            await _refuse(send, protocol.Refused(408, f"the body did not arrive within {self.body_timeout:g} s"))
            return
        except protocol.Refused as exc:
            await _refuse(send, protocol.UNAUTHENTICATED if await self._owner(token) is None else exc)
            return
        ask = lease_db.Ask(
            node_id=msg.node_id,
            token_hash=credentials.hash_secret(token),
            acks=tuple(msg.acks),
            status_digest=msg.status_digest,
        )
        try:
            answer = await self.writer.renew(ask)
        except Exception:
            await _refuse(send, protocol.Refused(503, "the lease could not be written; send it again"))
            return
        if answer is None:
            # Rare (a refusal): which one is worth a lookup.
            owner = await self._owner(token)
            await _refuse(send, protocol.UNAUTHENTICATED if owner is None else protocol.NOT_YOURS)
            return
        data = answer.model_dump_json().encode()
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    async def _read(self, headers: dict[bytes, str], receive: Receive) -> wire.Lease:
        content_type = (headers.get(b"content-type") or "").split(";")[0].strip().lower()
        check_envelope(content_type, headers.get(b"content-length"), MAX_LEASE_BODY)
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.body_timeout):
            while True:
                event = await receive()
                if event["type"] == "http.disconnect":
                    raise protocol.Refused(400, "the client left before its body arrived")
                chunk = event.get("body", b"")
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_LEASE_BODY or not event.get("more_body", False):
                    break
        msg = parse_message(wire.Lease, b"".join(chunks), max_body=MAX_LEASE_BODY)
        assert isinstance(msg, wire.Lease)
        return msg


_WANTED = (b"authorization", b"content-type", b"content-length")


def _headers(scope: Scope) -> dict[bytes, str]:
    # The three headers a lease needs, in one pass (the first of each, as agents/wakeup.py's _header).
    out: dict[bytes, str] = {}
    for k, v in scope.get("headers", ()):
        if k in _WANTED and k not in out:
            out[k] = v.decode("latin-1")
    return out


async def _refuse(send: Send, refused: protocol.Refused) -> None:
    """An error answer in the shape of every agent endpoint's (agents/api.py problem)."""
    extra = [(b"www-authenticate", b'Bearer realm="llmgw-agent"')] if refused.status == 401 else []
    await _answer(send, refused.status, {"detail": refused.detail, "errors": refused.errors or []}, extra)


def with_agent_lease(app: ASGIApp, *, endpoint: LeaseEndpoint | None = None) -> ASGIApp:
    """An ASGI application answering LEASE_PATH itself and passing everything else (lifespan too) to `app`."""
    lease = endpoint or LeaseEndpoint()
    dispatch = mount_path(app, LEASE_PATH, lease)
    dispatch.lease_endpoint = lease  # type: ignore[attr-defined]
    return dispatch
