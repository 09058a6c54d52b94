"""POST /api/v1/agent/lease: a node renews its lease between full heartbeats.

A lease (llmgw_wire/lease.py) says the node is alive and which commands it has
applied; the control plane keeps the node's last status (the telemetry
entry its last full heartbeat left) and answers with commands only when some
wait. The database work is inventory/lease.py: one statement when nothing
waits, a second when commands do. Nothing else is read: no shard states, no
telemetry; about one lease in STATUS_CHECK_EVERY makes one cache call that
renews the last status's time to live and says whether it is still there.

The refusals come in the order of every agent endpoint (agents/api.py):
401 (no credential, an unknown or revoked one), then the body (415, 413,
400), then 403 (a credential of another node). The body is read before the
database is asked, since the statement needs the node it names; telling a
bad body from a bad credential, or 401 from 403, costs a lookup of its own,
only on those refusals. A refused lease renews nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
import random

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

import llmgw_wire as wire
from agents import credentials, protocol
from agents.api import AgentEndpoint, KiB, documented, problem
from agents.models import NodeCredential
from inventory import lease as lease_db
from inventory import outbox
from inventory.models import Command

log = logging.getLogger(__name__)

TABLES = lease_db.Tables(credentials=NodeCredential._meta.db_table, commands=Command._meta.db_table)
# 256 acknowledgements of 36-character ids, as JSON, with room to spare.
MAX_LEASE_BODY = 16 * KiB
# A lease renews the time to live of the node's last status and learns whether the cache still
# holds it, at a cost (a Redis round trip) comparable to the renewal's own statement. The status
# outlives its time to live without it (the agent's status floor, at least every 60 s and under the
# 120 s time to live, checks and renews it), and a cache that lost it is rare: about one lease in 6
# asks, so a node whose status was lost is asked for it within about 30 s at a 5 s interval, and the
# others pay nothing. A lease carrying a status digest (the floor) is always checked.
STATUS_CHECK_EVERY = 6


def lease_request(token: str | None, body: protocol.Body[wire.Lease], *, now: dt.datetime) -> wire.LeaseResponse:
    """Authenticate a lease, renew it, acknowledge what it lists, and answer with the commands that wait.

    `body` is the request's body as its endpoint parsed it (its refusal, if it earned one). The
    answer asks for a full heartbeat at once (send_status, again) when the
    control plane no longer holds the node's last status, and says `again`
    when more commands wait than it carries.
    """
    if token is None or not token.startswith(credentials.NODE_PREFIX):
        raise protocol.UNAUTHENTICATED
    try:
        msg = body.message()
    except protocol.Refused:
        if credentials.authenticate_node(token) is None:
            raise protocol.UNAUTHENTICATED from None
        raise
    token_hash = credentials.hash_secret(token)
    renewal = lease_db.renew(TABLES, node_id=msg.node_id, token_hash=token_hash, now=now, acks=msg.acks)
    if renewal is None:
        # Rare (a refusal): which one is worth a lookup.
        raise protocol.UNAUTHENTICATED if credentials.authenticate_node(token) is None else protocol.NOT_YOURS
    if msg.status_digest is None:
        return lease_answer(renewal, token_hash=token_hash, now=now)
    # A status floor: checked on every one (see inventory/lease.py confirm_statuses).
    unconfirmed = lease_db.confirm_statuses({renewal.node_id: msg.status_digest})
    return lease_answer(renewal, token_hash=token_hash, now=now, want_status=bool(unconfirmed), floor=True)


def asks_status() -> bool:
    """Whether this lease is one of the one in STATUS_CHECK_EVERY that checks the node's last status is kept."""
    return random.random() * STATUS_CHECK_EVERY < 1


def lease_answer(
    renewal: lease_db.Renewal,
    *,
    token_hash: str,
    now: dt.datetime,
    want_status: bool | None = None,
    taken: tuple[list, bool] | None = None,
    floor: bool = False,
) -> wire.LeaseResponse:
    """The answer to a renewed lease: the commands that wait, and whether to come back at once.

    Also what a renewal finishes: a rotation whose new secret this lease used.
    Both lease endpoints answer with it (this one, and the batched one of agents/lease_asgi.py).
    `want_status`: whether the control plane lost the node's last status, when the caller
    already asked the cache (a batch asks for all its leases at once); None to ask here.
    `taken`: the node's waiting commands and whether more wait, when the caller took them
    (a batch takes them for all its nodes in one statement); None to take them here.
    `floor`: the lease carried a status digest, and `want_status` says whether it was not the
    digest of the status held; the answer says status_confirmed when it was.
    """
    if renewal.previous_hash is not None and renewal.token_hash == token_hash:
        # The agent uses the new secret of a rotation: the old one is done
        # (as agents/credentials.py does for every other request).
        NodeCredential.objects.filter(node_id=renewal.node_id, token_hash=token_hash).update(previous_hash=None)
    # About one lease in STATUS_CHECK_EVERY asks the cache (see there); the others cost it nothing.
    if want_status is None:
        want_status = asks_status() and not lease_db.keep_status(renewal.node_id)
    pending: list[outbox.WireCommand] = []
    more = False
    if renewal.waiting:
        rows, more = taken or lease_db.take_waiting(TABLES, renewal.node_id, now=now, limit=wire.MAX_COMMANDS)
        pending = [outbox.to_wire(Command(id=i, kind=k, payload=p)) for i, k, p in rows]
    # Every node renews every few seconds: routine, DEBUG (the commands it carries are logged where they are queued).
    log.debug("lease: node %s renewed, %d commands", renewal.node_id, len(pending))
    return wire.LeaseResponse(
        commands=pending,
        server_time=now.timestamp(),
        heartbeat_interval_s=settings.LLMGW_HEARTBEAT_INTERVAL,
        send_status=want_status,
        again=want_status or more,
        rotate_credential=True if renewal.rotation_requested_at is not None else None,
        status_confirmed=(not want_status) if floor else None,
    )


@documented(
    "agent_lease",
    wire.LeaseResponse,
    "A lease renewal between full heartbeats: the node is alive and has applied the commands in `acks`. "
    "The control plane keeps the node's last status; the answer carries the commands that wait, "
    "`send_status` when it wants a full heartbeat now, and `again` when the agent should come back "
    "at once rather than after its interval.",
)
class LeaseView(AgentEndpoint):
    """A node's lease renewal; the answer carries its pending commands until acknowledged."""

    message = wire.Lease
    max_body = MAX_LEASE_BODY

    def serve(self, django_request: HttpRequest) -> HttpResponse:
        now = timezone.now()
        token = credentials.bearer(django_request.META.get("HTTP_AUTHORIZATION"))
        try:
            result = lease_request(token, self.parse(django_request), now=now)
        except protocol.Refused as exc:
            return problem(exc.status, exc.detail, exc.errors)
        return self.answer(result)
