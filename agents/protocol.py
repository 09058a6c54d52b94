"""The agent conversation: registration, heartbeats, scan uploads, credential rotation.

The endpoints (agents/api.py) parse the body, once, into a Body; these
functions authenticate and decide, and raise a bad body's refusal only after
the authentication's, so a stranger learns nothing from the order. Each request is
applied whole or not at all (one transaction); what goes to the cache is
written only after the transaction committed.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from django.conf import settings
from django.db import IntegrityError, OperationalError, transaction

import llmgw_wire as wire
from agents import credentials
from agents.credentials import JoinAuth, NodeAuth
from inventory import changes, outbox, telemetry
from inventory import fabric as fabric_rules
from inventory import heartbeat as hb_rules
from inventory.nodes import upsert_node
from llmgw import db
from llmgw_wire import shard_states
from placement import agent_sync, queueing

M = TypeVar("M", bound=wire.Message)

log = logging.getLogger(__name__)
# A heartbeat that lost a deadlock runs again, this many times in all.
DEADLOCK_ATTEMPTS = 3


class Refused(Exception):
    """A request the protocol refuses, with the HTTP status and a message safe to show the caller.

    The message never says anything about a node other than the caller's own.
    """

    def __init__(self, status: int, detail: str, errors: list[dict] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        # For a bad body: each field's problem ({"field", "problem"}).
        self.errors = errors or []


UNAUTHENTICATED = Refused(401, "missing or invalid credentials")
# Deliberately the same words whichever node was named, and whether it exists.
NOT_YOURS = Refused(403, "this credential does not authorise requests about that node")


class Body(Generic[M]):
    """A request's body: the message, or the refusal it earns (raised by `message()`).

    Given `read`, the body is read and parsed only when `message()` is first
    called, which the protocol does once the caller is authenticated: a
    stranger's body is never read, so a stranger trickling one holds nothing.
    """

    def __init__(self, parsed: M | None = None, refused: Refused | None = None, *, read: Callable[[], M] | None = None):
        self.parsed = parsed
        self.refused = refused
        self._read = read
        # The digest of the bytes read (inventory/heartbeat.py status_digest), when the endpoint keeps one.
        self.digest: str | None = None

    def message(self) -> M:
        """The message; raises the body's refusal (415, 413, 400) when there is none."""
        if self._read is not None:
            read, self._read = self._read, None
            try:
                self.parsed = read()
            except Refused as exc:
                self.refused = exc
        if self.parsed is None:
            raise self.refused or Refused(400, "invalid request body")
        return self.parsed


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a node (by its credential) or a newcomer with a join token."""

    node: NodeAuth | None = None
    join: JoinAuth | None = None


def authenticate(token: str | None, *, now: dt.datetime, allow_join: bool) -> Caller:
    """Identify a request's bearer token; raises Refused(401) when it identifies no one.

    Node credentials carry their own prefix, so each request costs one lookup.
    """
    if token is None:
        raise UNAUTHENTICATED
    if token.startswith(credentials.NODE_PREFIX):
        auth = credentials.authenticate_node(token)
        if auth is None:
            raise UNAUTHENTICATED
        return Caller(node=auth)
    if allow_join:
        join = credentials.check_join_token(token, now=now)
        if join is not None:
            return Caller(join=join)
    raise UNAUTHENTICATED


def _own(caller: Caller, node_id: str) -> NodeAuth:
    if caller.node is None:
        raise UNAUTHENTICATED
    if caller.node.node_id != node_id:
        raise NOT_YOURS
    return caller.node


def register(caller: Caller, reg: wire.Register, *, now: dt.datetime) -> wire.RegisterResponse:
    """Upsert the node, adopt or fence its running shards, and answer with its pending commands.

    A node with a credential re-registers with it; a join token admits a node
    that has none (new, or reset by an operator) and issues its credential.
    """
    secret = None
    consume = False
    try:
        with transaction.atomic():
            if caller.node is not None:
                _own(caller, reg.node_id)
            else:
                assert caller.join is not None
                if credentials.has_credential(reg.node_id):
                    secret = credentials.rejoin(reg.node_id, join=caller.join, join_nonce=reg.join_nonce, now=now)
                    if secret is None:
                        # The node's refusal, in the words every other node gets: a join
                        # token's holder learns nothing about which node ids exist.
                        raise NOT_YOURS
                else:
                    consume = True
            issued = []
            if caller.join is not None and secret is None:
                secret, issued = credentials.new_credential(
                    reg.node_id, now=now, issued_by=caller.join.name, join_nonce=reg.join_nonce
                )
            # The credential's rows go with the node's: a new node is one INSERT statement.
            _, created = upsert_node(reg, now=now, with_rows=issued)
            sync = agent_sync.adopt_running(reg.node_id, reg.running_shards, now=now, new_node=created)
            if sync.changed:
                queueing.queue_reconcile()
            # A node inserted by this transaction has no commands (a command's node is a foreign
            # key) but the StopShards just queued for what it runs: a join storm is mostly new nodes.
            pending = outbox.pending(reg.node_id, now=now) if sync.fenced or not created else []
            # A join token's use is counted last: its row stays locked until the commit, and a rack
            # of nodes joining with one token queued on it for the whole of each other's writes.
            if consume and not credentials.consume_join_token(caller.join, now=now):
                raise UNAUTHENTICATED
    except IntegrityError as exc:
        # Two registrations of one new node id racing: the loser retries.
        raise Refused(409, "a concurrent registration of this node won; retry") from exc
    _forget_applied(reg.node_id)
    return wire.RegisterResponse(
        node_id=reg.node_id,
        credential=secret,
        heartbeat_interval_s=settings.LLMGW_HEARTBEAT_INTERVAL,
        adopted=sync.adopted,
        commands=pending,
        wakeup_url=settings.LLMGW_WAKEUP_URL or None,
        lease_url=settings.LLMGW_LEASE_URL or None,
    )


def _forget_applied(node_id: str) -> None:
    # Registration rewrote the GPUs and engine installs: the next heartbeat's
    # reports must be compared with the database again, not with the cache.
    entry = telemetry.get(node_id)
    if entry and entry.get("applied"):
        entry["applied"] = {}
        telemetry.put(node_id, entry)


def heartbeat(caller: Caller, hb: wire.Heartbeat, *, now: dt.datetime) -> wire.HeartbeatResponse:
    """Renew the node's lease, record what changed, and answer with its pending commands.

    For a caller already authenticated; the endpoint uses heartbeat_request,
    which authenticates and renews the lease in one statement.
    """
    auth = _own(caller, hb.node_id)
    previous = telemetry.get(hb.node_id)
    with transaction.atomic():
        # Asynchronous commit: the next heartbeat repeats all of this (inventory/heartbeat.py).
        touched = hb_rules.touch(hb.node_id, now=now, durable=False)
        if touched is None:
            raise UNAUTHENTICATED
        pending, applied = _record(hb, touched, previous, now=now)
    return _answer(auth, hb, previous, applied, pending, now=now)


def heartbeat_request(
    token: str | None, body: Body[wire.Heartbeat], *, now: dt.datetime, received: dt.datetime | None = None
) -> wire.HeartbeatResponse:
    """A heartbeat from its bearer token on: authenticate, take the parsed body, and do what heartbeat does.

    A steady-state heartbeat costs two statements whatever it carries: the
    credential lookup with the lease update, and the read of the shards it
    reports with its pending commands; one for a node with no shards and no
    command waiting (the lease update says none waits). Telemetry goes to
    the cache. The refusals come in the endpoints' order: 401, then the
    body's (415, 413, 400), then 403; a refused heartbeat leaves nothing
    written, the lease renewal included (it is rolled back). `received`: when
    the request arrived, if it waited for a thread (the telemetry's time, so
    that a wait is not read as the agent's clock skew).
    """
    if token is None:
        raise UNAUTHENTICATED
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            with transaction.atomic():
                found = credentials.authenticate_and_touch(token, now=now, durable=False)
                if found is None:
                    raise UNAUTHENTICATED
                auth, touched = found
                hb = body.message()
                _own(Caller(node=auth), hb.node_id)
                previous = telemetry.get(hb.node_id)
                pending, applied = _record(hb, touched, previous, now=now)
            break
        except OperationalError as exc:
            # The node's row, then its shards' replicas (their events' keys, checked at the commit),
            # against a writer that locked a replica and then the node: PostgreSQL aborts one of
            # the two, and the heartbeat, all of whose work is in this transaction, runs again.
            if attempt == DEADLOCK_ATTEMPTS or not db.is_deadlock(exc):
                raise
            log.info("a heartbeat deadlocked (attempt %d); running it again", attempt)
    return _answer(auth, hb, previous, applied, pending, now=now, received=received, digest=body.digest)


def _record(
    hb: wire.Heartbeat, touched: hb_rules.Touched, previous: dict | None, *, now: dt.datetime
) -> tuple[list, dict]:
    # In the caller's transaction, after the lease renewal: (pending commands, what the cache records as applied).
    node_id = hb.node_id
    applied = dict((previous or {}).get("applied") or {})
    pending_rows = None
    if hb.acks:
        outbox.acknowledge(node_id, hb.acks, now=now)
    if hb.shards:
        # The pending commands come with the shards' read: one round trip fewer (after the acks, so
        # what they acknowledged is not delivered again).
        sync = agent_sync.record_shard_states(node_id, hb.shards, now=now, pending_limit=wire.MAX_COMMANDS)
        pending_rows = sync.pending
        if sync.changed:
            queueing.queue_reconcile()
            if any(to in shard_states.TERMINAL for _, _, to in sync.changed):
                # What the placement index reads of a shard is its ports, held until it ends: a start's
                # starting, loading and ready move none of it, and marking them had each scale-up's
                # nodes reloaded three times over while the next replicas waited to be placed.
                changes.mark([node_id])
    if hb.gpu_fabrics is not None:
        d = hb_rules.digest(hb.gpu_fabrics)
        if applied.get("fabrics") != d:
            hb_rules.apply_gpu_fabrics(node_id, hb.gpu_fabrics, current_domain=touched.nvlink_domain, now=now)
            applied["fabrics"] = d
    if hb.engine_installs is not None:
        d = hb_rules.digest(hb.engine_installs)
        if applied.get("installs") != d:
            hb_rules.apply_engine_installs(node_id, hb.engine_installs)
            applied["installs"] = d
    if hb.imex is not None:
        hb_rules.apply_imex(node_id, hb.imex, touched=touched, now=now)
    if hb.ib_ports:
        hb_rules.record_sm_changes(node_id, hb.ib_ports, previous, now=now)
    if pending_rows is None and not touched.waiting:
        # None was waiting as the lease was renewed: one committed since is announced by the next lease.
        pending_rows = []
    return outbox.pending(node_id, now=now, rows=pending_rows), applied


def _answer(
    auth: NodeAuth,
    hb: wire.Heartbeat,
    previous: dict | None,
    applied: dict,
    pending: list,
    *,
    now: dt.datetime,
    received: dt.datetime | None = None,
    digest: str | None = None,
) -> wire.HeartbeatResponse:
    # After the commit: the cache never holds what the database rolled back. The telemetry is dated when
    # the status arrived: a wait for a thread read against the agent's clock showed as its skew, and a
    # skew that moved with every routine status marked every node for the doctor and placement again.
    entry = hb_rules.telemetry(hb, previous, now=received or now)
    entry["applied"] = applied
    if digest is None:
        # Not read from bytes (a caller handing the message itself): the digest of its own serialisation.
        digest = hb_rules.status_digest(hb.model_dump_json().encode())
    # The digest beside the entry: the agent's floor sends it back instead of the whole status (agents/lease.py).
    telemetry.put(hb.node_id, entry, digest=digest)
    changes.mark_telemetry(hb.node_id, previous, entry)
    return wire.HeartbeatResponse(
        commands=pending,
        server_time=now.timestamp(),
        heartbeat_interval_s=settings.LLMGW_HEARTBEAT_INTERVAL,
        rotate_credential=True if auth.rotation_requested else None,
        # Between full heartbeats the agent may renew its lease alone (agents/lease.py).
        leases=True,
        # Where to hold the wakeup long-poll: an agent configured with none uses this one.
        wakeup_url=settings.LLMGW_WAKEUP_URL or None,
        # Where to send leases (the gateway's batched endpoint, agents/lease_asgi.py); this endpoint otherwise.
        lease_url=settings.LLMGW_LEASE_URL or None,
        status_digest=digest,
    )


def upload_scan(caller: Caller, scan: wire.ScanUpload, *, now: dt.datetime) -> dict:
    """Keep a fabric scan's text (or its error beside the last good text).

    Only the node a ScanFabric was sent to may answer it, for that command's
    fabric and port, and once (403 naming why otherwise).
    """
    _own(caller, scan.node_id)
    with transaction.atomic():
        why = outbox.claim_scan(scan.node_id, scan.command_id, scan.key, hca=scan.hca, port=scan.port, now=now)
        if why:
            raise Refused(403, why)
        row = fabric_rules.set_scan(
            key=scan.key,
            at=now,
            node_id=scan.node_id,
            port=f"{scan.hca}/{scan.port}" if scan.hca else "",
            output=scan.output,
            error=scan.error,
            took_s=scan.took_s,
        )
    return {"key": row.key, "at": row.at.timestamp(), "error": row.error, "has_output": bool(row.output)}


def rotate(caller: Caller, body: wire.RotateCredential, *, now: dt.datetime) -> wire.RegisterResponse:
    """Issue the calling node a new credential; the current one works until the new one is used."""
    _own(caller, body.node_id)
    secret = credentials.rotate(body.node_id, now=now)
    return wire.RegisterResponse(
        node_id=body.node_id, credential=secret, heartbeat_interval_s=settings.LLMGW_HEARTBEAT_INTERVAL
    )
