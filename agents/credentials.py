"""Join tokens and node credentials: who may speak for which node.

A node joins with a join token (one created in the admin, or the bootstrap
token from LLMGW_JOIN_TOKEN) and receives its own credential. After that the
credential authorises that node alone, like Kubernetes' node authorizer: a
request naming another node is refused. Only SHA-256 hashes are stored; the
secrets are 256-bit random, so a plain hash is enough (no salt or slow hash is
needed against brute force) and authentication is one indexed lookup.

Rotation: the agent calls the rotate endpoint with its current credential and
receives a new one; the old one keeps working until the new one is first used,
so a lost answer does not lock the agent out. An operator can ask for a
rotation (the next heartbeat answer carries `rotate_credential`), or reset a
credential: it stops working at once and the node may join again with a join
token. Without a reset, a join token cannot take over a node that has a
credential.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from agents.models import JoinToken, NodeCredential
from inventory.heartbeat import NodeLookup, Touched, touch_found
from inventory.models import Node, NodeEvent
from inventory.node_view import CredentialBox
from inventory.nodes import event_row, record_event
from llmgw.db import prepared_cursor

NODE_PREFIX = "llmgw-node-"
JOIN_PREFIX = "llmgw-join-"


def hash_secret(secret: str) -> str:
    """The stored form of a secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret(prefix: str) -> str:
    """A fresh 256-bit secret, prefixed so a leaked one is recognisable in logs and scanners."""
    return prefix + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class NodeAuth:
    """A request authenticated as one node."""

    node_id: str
    # The request used the previous secret of a rotation.
    used_previous: bool
    rotation_requested: bool


@dataclass(frozen=True)
class JoinAuth:
    """A request carrying a valid join token (not yet counted as used)."""

    token_id: int | None
    name: str


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None when absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    return token


def authenticate_node(token: str) -> NodeAuth | None:
    """The node a credential belongs to, None when it belongs to none.

    The current and the previous hash are both unique and indexed: one query.
    """
    h = hash_secret(token)
    # Hand-written SQL: this runs on every heartbeat, and the ORM's query
    # building costs more than the indexed lookup itself.
    with prepared_cursor() as cur:
        cur.execute(
            f"SELECT node_id, token_hash, previous_hash, rotation_requested_at FROM {NodeCredential._meta.db_table} "
            "WHERE token_hash = %s OR previous_hash = %s LIMIT 1",
            [h, h],
        )
        row = cur.fetchone()
    if row is None:
        return None
    return _node_auth(row[0], h, row[1], row[2], row[3])


def authenticate_and_touch(token: str, *, now: dt.datetime, durable: bool = True) -> tuple[NodeAuth, Touched] | None:
    """authenticate_node and the lease renewal of its node (inventory/heartbeat.py touch) in one statement.

    For the heartbeat, whose credential lookup would otherwise be a round
    trip of its own. None when the credential belongs to no node; the caller
    must refuse, and roll the lease back, when the request turns out not to
    be the node's to make.
    """
    if not token.startswith(NODE_PREFIX):
        return None
    h = hash_secret(token)
    found = touch_credential_holder(h, now=now, durable=durable)
    if found is None:
        return None
    (node_id, current, previous, requested), touched = found
    return _node_auth(node_id, h, current, previous, requested), touched


def touch_credential_holder(
    token_hash: str, *, now: dt.datetime, durable: bool = True
) -> tuple[tuple[str, str, str | None, dt.datetime | None], Touched] | None:
    """The lease renewal (inventory/heartbeat.py touch) of the node holding a credential, found in the same statement.

    Found by its current or previous hash. Returns the credential's (node id,
    token hash, previous hash, rotation requested at) and the touched node;
    None when no node holds that hash.
    """
    lookup = NodeLookup(
        table=NodeCredential._meta.db_table,
        where="c.token_hash = %s OR c.previous_hash = %s",
        params=(token_hash, token_hash),
        columns=("node_id", "token_hash", "previous_hash", "rotation_requested_at"),
    )
    found = touch_found(lookup, now=now, durable=durable)
    if found is None:
        return None
    (node_id, current, previous, requested), touched = found
    return (node_id, current, previous, requested), touched


def _node_auth(node_id: str, h: str, current: str, previous: str | None, requested) -> NodeAuth:
    used_previous = current != h
    if not used_previous and previous is not None:
        # The agent has the new secret: the old one is done.
        NodeCredential.objects.filter(node_id=node_id, token_hash=h).update(previous_hash=None)
    return NodeAuth(node_id=node_id, used_previous=used_previous, rotation_requested=requested is not None)


def _usable_join_tokens(now: dt.datetime):
    # Not revoked, not expired, not used up.
    return JoinToken.objects.filter(revoked_at__isnull=True, expires_at__gt=now).filter(
        Q(max_uses__isnull=True) | Q(uses__lt=F("max_uses"))
    )


def check_join_token(token: str, *, now: dt.datetime) -> JoinAuth | None:
    """Whether a token is a join token: the bootstrap token, or an admin-created one not revoked or expired.

    One that is used up still identifies its holder: a retry of a join whose
    answer was lost (rejoin) needs no new use, while a new node is refused
    when consume_join_token finds no use left.
    """
    bootstrap = settings.LLMGW_JOIN_TOKEN
    if bootstrap and hmac.compare_digest(token.encode(), bootstrap.encode()):
        return JoinAuth(token_id=None, name="bootstrap token")
    row = (
        JoinToken.objects.filter(revoked_at__isnull=True, expires_at__gt=now, token_hash=hash_secret(token))
        .values_list("id", "name")
        .first()
    )
    if row is None:
        return None
    return JoinAuth(token_id=row[0], name=row[1])


def consume_join_token(auth: JoinAuth, *, now: dt.datetime) -> bool:
    """Count one use of a join token, atomically; False when it ran out meanwhile.

    The condition is re-checked in the UPDATE itself, so two nodes racing for
    the last use cannot both have it.
    """
    if auth.token_id is None:
        return True
    return bool(_usable_join_tokens(now).filter(id=auth.token_id).update(uses=F("uses") + 1))


def has_credential(node_id: str) -> bool:
    """Whether a node holds a credential (a join token cannot then take it over)."""
    # Hand-written SQL: every join of a storm asks, and the ORM's query building cost more than the lookup.
    with prepared_cursor() as cur:
        cur.execute(f"SELECT 1 FROM {NodeCredential._meta.db_table} WHERE node_id = %s LIMIT 1", [node_id])
        return cur.fetchone() is not None


def issue(node_id: str, *, now: dt.datetime, issued_by: str, join_nonce: str | None = None) -> str:
    """Give a node a new credential, replacing none (the caller checked there is none); returns the secret."""
    secret, rows = new_credential(node_id, now=now, issued_by=issued_by, join_nonce=join_nonce)
    for row in rows:
        row.save(force_insert=True)
    return secret


def new_credential(
    node_id: str, *, now: dt.datetime, issued_by: str, join_nonce: str | None = None
) -> tuple[str, list[NodeCredential | NodeEvent]]:
    """A new credential for a node that has none: the secret, and the rows to insert (the credential, its event).

    Unsaved, so that a registration writes them with the new node's own rows
    in one statement (inventory/nodes.py upsert_node).
    """
    secret = new_secret(NODE_PREFIX)
    cred = NodeCredential(
        node_id=node_id,
        token_hash=hash_secret(secret),
        issued_at=now,
        issued_by=issued_by,
        join_nonce_hash=hash_secret(join_nonce) if join_nonce else "",
    )
    event = event_row(node_id, "credential", f"credential issued ({issued_by})", now=now, actor_name="agent")
    return secret, [cred, event]


def rejoin(node_id: str, *, join: JoinAuth, join_nonce: str | None, now: dt.datetime) -> str | None:
    """A retry of a join whose answer was lost: the credential again (a new secret), or None when it is not one.

    A retry is the same node, the same join token, the same nonce (a secret
    only that agent holds, drawn before its first try), within
    LLMGW_JOIN_RETRY_WINDOW of the first answer, and before the credential
    was ever rotated. The join token's use was counted by the first try and
    is not counted again: under a registration storm an agent that timed out
    while the server went on must not be locked out by its own retry.
    """
    if not join_nonce:
        return None
    since = now - dt.timedelta(seconds=settings.LLMGW_JOIN_RETRY_WINDOW)
    secret = new_secret(NODE_PREFIX)
    with transaction.atomic():
        done = NodeCredential.objects.filter(
            node_id=node_id,
            issued_by=join.name,
            join_nonce_hash=hash_secret(join_nonce),
            issued_at__gte=since,
            previous_hash__isnull=True,
        ).update(token_hash=hash_secret(secret), issued_at=now)
        if not done:
            return None
        record_event(
            node_id, "credential", f"credential issued again: a retried join ({join.name})", now=now, actor_name="agent"
        )
    return secret


def rotate(node_id: str, *, now: dt.datetime) -> str:
    """Replace a node's credential; the current one stays valid until the new one is used.

    A rotation while one is already outstanding keeps the oldest secret valid
    (the agent may never have received the middle one).
    """
    secret = new_secret(NODE_PREFIX)
    with transaction.atomic():
        cred = NodeCredential.objects.select_for_update().get(node_id=node_id)
        if cred.previous_hash is None:
            cred.previous_hash = cred.token_hash
        cred.token_hash = hash_secret(secret)
        cred.issued_at = now
        cred.issued_by = "rotation"
        cred.rotation_requested_at = None
        cred.join_nonce_hash = ""
        cred.save()
        record_event(node_id, "credential", "credential rotated", now=now, actor_name="agent")
    return secret


def request_rotation(node_id: str, *, now: dt.datetime, actor=None) -> bool:
    """Ask a node's agent to rotate its credential at its next heartbeat."""
    with transaction.atomic():
        done = NodeCredential.objects.filter(node_id=node_id).update(rotation_requested_at=now)
        if done:
            record_event(node_id, "credential", "credential rotation requested", now=now, actor=actor)
    return bool(done)


def reset(node_id: str, *, now: dt.datetime, actor=None) -> bool:
    """Revoke a node's credential at once; the node may then join again with a join token.

    For a reinstalled machine that lost its state directory, or a credential
    that leaked.
    """
    with transaction.atomic():
        deleted, _ = NodeCredential.objects.filter(node_id=node_id).delete()
        if deleted:
            record_event(node_id, "credential", "credential reset: the node must join again", now=now, actor=actor)
    return bool(deleted)


def create_join_token(
    *,
    name: str,
    expires_at: dt.datetime,
    max_uses: int | None,
    now: dt.datetime,
    created_by=None,
    token: JoinToken | None = None,
) -> tuple[JoinToken, str]:
    """Create a join token; returns it and its secret, which is never stored or shown again.

    `token` is an unsaved instance to fill (the admin's form object).
    """
    secret = new_secret(JOIN_PREFIX)
    token = token or JoinToken()
    token.name = name
    token.token_hash = hash_secret(secret)
    token.prefix = secret[: len(JOIN_PREFIX) + 6]
    token.expires_at = expires_at
    token.max_uses = max_uses
    token.created_at = now
    token.created_by = created_by
    token.save()
    return token, secret


def revoke_join_token(token_id: int, *, now: dt.datetime) -> bool:
    """Stop a join token from admitting anyone else."""
    return bool(JoinToken.objects.filter(id=token_id, revoked_at__isnull=True).update(revoked_at=now))


def credential_box(node: Node) -> CredentialBox:
    """What the node page's Credential box says about `node`'s credential (one query).

    Registered with inventory/node_view.py, which draws the box.
    """
    cred = NodeCredential.objects.filter(node_id=node.id).first()
    if cred is None:
        return CredentialBox(present=False)
    return CredentialBox(
        present=True,
        issued_at=cred.issued_at,
        issued_by=cred.issued_by,
        rotation_requested_at=cred.rotation_requested_at,
        rotation_pending=cred.previous_hash is not None,
        last_used=node.last_seen,
    )
