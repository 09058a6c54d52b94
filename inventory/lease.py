"""A lease renewal in the database: one small statement when no command waits, a second when some do.

Ten thousand nodes renewing every 5 s are 2,000 renewals a second, so each
one must cost PostgreSQL as little as an indexed UPDATE can. One statement
authenticates the node's credential (by its hash, current or previous, and
only for the node the body names), renews last_seen, acknowledges the
commands the lease lists, and says whether any other command waits; it runs
outside any transaction (a single statement is atomic on its own) and commits
asynchronously, like a heartbeat: a lease lost in a database crash is sent
again 5 s later. Only when commands wait does a second statement fetch them
and count their delivery.

The tables of the credentials and the command queue are the caller's to
name (`Tables`): the inventory does not import the apps that own them.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction

from inventory import telemetry
from inventory.models import Node, NodeState
from inventory.nodes import change_state
from llmgw.db import prepared_cursor


@dataclass(frozen=True)
class Tables:
    """Where the credentials and the command queue live (their db_table names).

    credentials: node_id (primary key), token_hash, previous_hash, rotation_requested_at.
    commands: id (uuid), node_id, kind, payload (json), created_at, acked_at, deliveries, first_delivered_at.
    """

    credentials: str
    commands: str


@dataclass(frozen=True)
class Renewal:
    """A renewed lease: the credential's row as the statement found it, and whether commands wait."""

    node_id: str
    token_hash: str
    previous_hash: str | None
    rotation_requested_at: dt.datetime | None
    state: str
    # Commands not acknowledged (other than those this lease acknowledged).
    waiting: bool


@functools.cache
def renewal_sql(tables: Tables, *, acks: bool, relax: bool) -> str:
    """The PostgreSQL statement renewing a lease (parameters: see renew)."""
    node = Node._meta.db_table
    relax_item = ", (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit" if relax else ""
    # The credential must be the named node's: a credential of another node
    # matches no row, and renews nothing.
    cred_match = "c.node_id = %(node)s AND (c.token_hash = %(hash)s OR c.previous_hash = %(hash)s)"
    ack_cte = not_acked = ""
    if acks:
        # A data-modifying CTE sees the snapshot the main statement sees, so the
        # commands it acknowledges still look pending below: they are left out by id.
        ack_cte = (
            f"WITH acked AS (UPDATE {tables.commands} SET acked_at = %(now)s "
            f"WHERE node_id = %(node)s AND id = ANY(%(acks)s) AND acked_at IS NULL "
            f"AND EXISTS (SELECT 1 FROM {tables.credentials} AS c WHERE {cred_match}) RETURNING id) "
        )
        not_acked = " AND NOT (m.id = ANY(%(acks)s))"
    return (
        f"{ack_cte}UPDATE {node} AS n SET last_seen = %(now)s, unreachable_since = NULL "
        f"FROM {tables.credentials} AS c{relax_item} "
        f"WHERE {cred_match} AND n.id = c.node_id "
        "RETURNING c.token_hash, c.previous_hash, c.rotation_requested_at, n.state, "
        f"EXISTS (SELECT 1 FROM {tables.commands} AS m WHERE m.node_id = n.id AND m.acked_at IS NULL{not_acked})"
    )


def renew(
    tables: Tables,
    *,
    node_id: str,
    token_hash: str,
    now: dt.datetime,
    acks: Sequence[str] = (),
    durable: bool = False,
) -> Renewal | None:
    """Renew `node_id`'s lease if `token_hash` is its credential's (current or previous); None when it is not.

    None says nothing about why (no such credential, or another node's): the
    caller asks the credentials when it must tell 401 from 403. Acks that are
    not UUIDs are ignored; so are ids of other nodes' commands. A node that
    was unreachable or lost comes back to ready (statements of their own, as
    rare as the silence that caused them).
    """
    ack_ids = _uuids(acks)
    if connection.vendor != "postgresql":
        return _renew_portable(tables, node_id=node_id, token_hash=token_hash, now=now, acks=ack_ids)
    sql = renewal_sql(tables, acks=bool(ack_ids), relax=not durable)
    with prepared_cursor() as cur:
        cur.execute(sql, {"now": now, "node": node_id, "hash": token_hash, "acks": ack_ids})
        row = cur.fetchone()
    if row is None:
        return None
    return _renewal(node_id, row, now=now)


@dataclass(frozen=True)
class Ask:
    """One lease of a batch: the node it names, the hash of the credential it came with, what it acknowledges.

    `status_digest`: the status floor it stands for (see confirm_statuses), None for an ordinary lease.
    """

    node_id: str
    token_hash: str
    acks: Sequence[str] = ()
    status_digest: str | None = None


@functools.cache
def batch_sql(tables: Tables, *, acks: bool, relax: bool) -> str:
    """The PostgreSQL statement renewing a batch of leases (parameters: see renew_batch).

    The same work as renewal_sql, for every lease of the batch in one
    statement: the leases arrive as arrays, joined to the credentials (a
    lease whose credential is not its node's, current or previous, matches no
    row and renews nothing) and to the nodes by primary key.
    """
    node = Node._meta.db_table
    relax_item = ", (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit" if relax else ""
    ack_cte = not_acked = ""
    if acks:
        # As in renewal_sql: the commands acknowledged here still look pending to the main
        # statement (one snapshot), so they are left out by id. An ack counts only with its
        # lease's credential, and only for that node's own commands.
        ack_cte = (
            f"WITH acked AS (UPDATE {tables.commands} AS m SET acked_at = %(now)s "
            "FROM unnest(%(ack_nodes)s::varchar[], %(ack_hashes)s::varchar[], %(ack_ids)s::uuid[]) "
            "AS a(node_id, h, id) "
            f"JOIN {tables.credentials} AS ac ON ac.node_id = a.node_id "
            "AND (ac.token_hash = a.h OR ac.previous_hash = a.h) "
            "WHERE m.id = a.id AND m.node_id = a.node_id AND m.acked_at IS NULL RETURNING m.id) "
        )
        not_acked = " AND NOT EXISTS (SELECT 1 FROM acked WHERE acked.id = m.id)"
    # A node's row locked by another transaction (its own full heartbeat, an operator's change) is
    # skipped, not waited for: one busy row must not hold every other node's lease of the batch, or a
    # fleet renewing through one writer goes silent together while it waits (read as a mass silence).
    # The skipped nodes come back flagged (renewed false) for the next batch.
    head = f"{ack_cte.rstrip()}, " if ack_cte else "WITH "
    return (
        f"{head}v AS (SELECT * FROM unnest(%(nodes)s::varchar[], %(hashes)s::varchar[]) AS v(node_id, h)), "
        f"free AS (SELECT f.id FROM {node} AS f WHERE f.id = ANY(%(nodes)s::varchar[]) "
        "ORDER BY f.id FOR NO KEY UPDATE SKIP LOCKED), "
        f"renewed AS (UPDATE {node} AS n SET last_seen = %(now)s, unreachable_since = NULL "
        f"FROM v JOIN {tables.credentials} AS c ON c.node_id = v.node_id "
        "AND (c.token_hash = v.h OR c.previous_hash = v.h)"
        f"{relax_item} WHERE n.id = v.node_id AND n.id IN (SELECT id FROM free) "
        "RETURNING n.id, c.token_hash, c.previous_hash, c.rotation_requested_at, n.state, "
        f"EXISTS (SELECT 1 FROM {tables.commands} AS m WHERE m.node_id = n.id AND m.acked_at IS NULL{not_acked}) "
        "AS waiting) "
        "SELECT true, r.* FROM renewed AS r UNION ALL "
        "SELECT false, v.node_id, NULL::varchar, NULL::varchar, NULL::timestamptz, NULL::varchar, NULL::boolean "
        "FROM v WHERE NOT EXISTS (SELECT 1 FROM free WHERE free.id = v.node_id) "
        f"AND EXISTS (SELECT 1 FROM {node} AS x WHERE x.id = v.node_id)"
    )


def renew_batch(
    tables: Tables,
    asks: Sequence[Ask],
    *,
    now: dt.datetime,
    durable: bool = False,
    busy: set[str] | None = None,
) -> dict[str, Renewal]:
    """Renew every lease of a batch whose credential is its node's; the renewals by node id.

    One statement on PostgreSQL however many leases the batch holds (with
    their acks): what a lease costs the database shrinks with the batch. A
    node missing from the answer renewed nothing (as renew's None). At most
    one lease per node: raises ValueError for a node named twice (of two
    leases of one node, the statement would keep only one). The statement
    commits asynchronously unless `durable`, like renew; a node that was
    unreachable or lost comes back to ready, as with renew. A node whose
    row another transaction holds is not waited for: it renewed nothing yet,
    and its id is added to `busy` (when given) for the caller to send again.
    """
    nodes = [a.node_id for a in asks]
    if len(set(nodes)) != len(nodes):
        raise ValueError("a batch holds at most one lease per node")
    if not asks:
        return {}
    if connection.vendor != "postgresql":
        found = (
            _renew_portable(tables, node_id=a.node_id, token_hash=a.token_hash, now=now, acks=_uuids(a.acks))
            for a in asks
        )
        return {r.node_id: r for r in found if r is not None}
    # Rows locked in one order (the nodes' ids) by every batch, so two batches never deadlock each other.
    ordered = sorted(asks, key=lambda a: a.node_id)
    ack_nodes, ack_hashes, ack_ids = [], [], []
    for a in ordered:
        for i in _uuids(a.acks):
            ack_nodes.append(a.node_id)
            ack_hashes.append(a.token_hash)
            ack_ids.append(i)
    params = {"now": now, "nodes": [a.node_id for a in ordered], "hashes": [a.token_hash for a in ordered]}
    if ack_ids:
        params.update(ack_nodes=ack_nodes, ack_hashes=ack_hashes, ack_ids=ack_ids)
    with prepared_cursor() as cur:
        cur.execute(batch_sql(tables, acks=bool(ack_ids), relax=not durable), params)
        rows = cur.fetchall()
    if busy is not None:
        busy.update(row[1] for row in rows if not row[0])
    return {row[1]: _renewal(row[1], row[2:], now=now) for row in rows if row[0]}


def _uuids(ids: Sequence[str]) -> list[uuid.UUID]:
    out = []
    for i in ids:
        try:
            out.append(uuid.UUID(str(i)))
        except ValueError:
            continue
    return out


def _renewal(node_id: str, row: Sequence, *, now: dt.datetime) -> Renewal:
    state = row[3]
    if state in (NodeState.UNREACHABLE, NodeState.LOST) and change_state(
        node_id, NodeState.READY, now=now, expected=state, reason="heartbeat resumed", actor_name="agent"
    ):
        state = NodeState.READY
    return Renewal(
        node_id=node_id,
        token_hash=row[0],
        previous_hash=row[1],
        rotation_requested_at=row[2],
        state=state,
        waiting=bool(row[4]),
    )


def _renew_portable(
    tables: Tables, *, node_id: str, token_hash: str, now: dt.datetime, acks: list[uuid.UUID]
) -> Renewal | None:
    # SQLite (the embedded default) cannot return columns of an UPDATE's FROM
    # items, and has no round trip to save: the same steps, one at a time, in
    # one transaction. Django keeps its UUIDs there as 32 hex digits.
    with transaction.atomic(), prepared_cursor() as cur:
        cur.execute(
            f"SELECT token_hash, previous_hash, rotation_requested_at FROM {tables.credentials} "
            "WHERE node_id = %s AND (token_hash = %s OR previous_hash = %s)",
            [node_id, token_hash, token_hash],
        )
        cred = cur.fetchone()
        if cred is None:
            return None
        cur.execute(
            f"UPDATE {Node._meta.db_table} SET last_seen = %s, unreachable_since = NULL WHERE id = %s",
            [now, node_id],
        )
        cur.execute(f"SELECT state FROM {Node._meta.db_table} WHERE id = %s", [node_id])
        found = cur.fetchone()
        if found is None:
            return None
        hexes = [a.hex for a in acks]
        marks = ", ".join(["%s"] * len(hexes))
        if hexes:
            cur.execute(
                f"UPDATE {tables.commands} SET acked_at = %s "
                f"WHERE node_id = %s AND acked_at IS NULL AND id IN ({marks})",
                [now, node_id, *hexes],
            )
        cur.execute(
            f"SELECT 1 FROM {tables.commands} WHERE node_id = %s AND acked_at IS NULL LIMIT 1",
            [node_id],
        )
        waiting = cur.fetchone() is not None
    return _renewal(node_id, (*cred, found[0], waiting), now=now)


@functools.cache
def take_sql(tables: Tables) -> str:
    """The PostgreSQL statement fetching a node's waiting commands and counting their delivery."""
    t = tables.commands
    return (
        f"WITH w AS (SELECT id, created_at FROM {t} WHERE node_id = %(node)s AND acked_at IS NULL "
        "ORDER BY created_at, id LIMIT %(more)s), "
        f"u AS (UPDATE {t} AS m SET deliveries = m.deliveries + 1, "
        "first_delivered_at = COALESCE(m.first_delivered_at, %(now)s) "
        "FROM (SELECT id FROM w ORDER BY created_at, id LIMIT %(limit)s) AS s WHERE m.id = s.id "
        "RETURNING m.id, m.kind, m.payload, m.created_at) "
        "SELECT id, kind, payload, (SELECT count(*) FROM w) FROM u ORDER BY created_at, id"
    )


def take_waiting(
    tables: Tables, node_id: str, *, now: dt.datetime, limit: int
) -> tuple[list[tuple[uuid.UUID, str, dict]], bool]:
    """A node's oldest `limit` pending commands as (id, kind, payload), counted delivered; and whether more wait.

    One statement on PostgreSQL. They stay pending until acknowledged.
    """
    if connection.vendor != "postgresql":
        return _take_portable(tables, node_id, now=now, limit=limit)
    with prepared_cursor() as cur:
        cur.execute(take_sql(tables), {"node": node_id, "now": now, "limit": limit, "more": limit + 1})
        rows = cur.fetchall()
    more = bool(rows) and rows[0][3] > limit
    return [(r[0], r[1], _json(r[2])) for r in rows], more


@functools.cache
def take_batch_sql(tables: Tables) -> str:
    """The PostgreSQL statement fetching the waiting commands of several nodes and counting their delivery.

    The same work as take_sql for every node of a lease batch with commands
    waiting: each node's oldest %(limit)s, and a rank past it to tell that more wait.
    """
    t = tables.commands
    return (
        "WITH r AS (SELECT id, node_id, created_at, "
        "row_number() OVER (PARTITION BY node_id ORDER BY created_at, id) AS k "
        f"FROM {t} WHERE node_id = ANY(%(nodes)s::varchar[]) AND acked_at IS NULL), "
        "w AS (SELECT id, node_id, k FROM r WHERE k <= %(more)s), "
        f"u AS (UPDATE {t} AS m SET deliveries = m.deliveries + 1, "
        "first_delivered_at = COALESCE(m.first_delivered_at, %(now)s) "
        "FROM w WHERE m.id = w.id AND w.k <= %(limit)s RETURNING m.node_id, m.id, m.kind, m.payload, w.k) "
        "SELECT u.node_id, u.id, u.kind, u.payload, (SELECT max(x.k) FROM w AS x WHERE x.node_id = u.node_id) "
        "FROM u ORDER BY u.node_id, u.k"
    )


def take_waiting_batch(
    tables: Tables, node_ids: Sequence[str], *, now: dt.datetime, limit: int
) -> dict[str, tuple[list[tuple[uuid.UUID, str, dict]], bool]]:
    """take_waiting for every node of `node_ids` at once: by node, its commands and whether more wait.

    One statement on PostgreSQL however many nodes: a scale-up's leases carry
    commands to a thousand nodes together, and a statement each had the
    lease writer's one thread spend its batches on round trips. A node with
    nothing waiting any more is absent.
    """
    if not node_ids:
        return {}
    if connection.vendor != "postgresql":
        found = {n: _take_portable(tables, n, now=now, limit=limit) for n in node_ids}
        return {n: got for n, got in found.items() if got[0]}
    params = {"nodes": sorted(set(node_ids)), "now": now, "limit": limit, "more": limit + 1}
    with prepared_cursor() as cur:
        cur.execute(take_batch_sql(tables), params)
        rows = cur.fetchall()
    out: dict[str, tuple[list[tuple[uuid.UUID, str, dict]], bool]] = {}
    for node_id, i, kind, payload, deepest in rows:
        taken = out.setdefault(node_id, ([], deepest > limit))
        taken[0].append((i, kind, _json(payload)))
    return out


def _json(value: Any) -> dict:
    # Django has psycopg hand JSON columns over as text (and SQLite has nothing else).
    return json.loads(value) if isinstance(value, str | bytes) else value


def _take_portable(
    tables: Tables, node_id: str, *, now: dt.datetime, limit: int
) -> tuple[list[tuple[uuid.UUID, str, dict]], bool]:
    with transaction.atomic(), prepared_cursor() as cur:
        cur.execute(
            f"SELECT id, kind, payload FROM {tables.commands} WHERE node_id = %s AND acked_at IS NULL "
            "ORDER BY created_at, id LIMIT %s",
            [node_id, limit + 1],
        )
        found = cur.fetchall()
        rows = found[:limit]
        if rows:
            marks = ", ".join(["%s"] * len(rows))
            cur.execute(
                f"UPDATE {tables.commands} SET deliveries = deliveries + 1, "
                f"first_delivered_at = COALESCE(first_delivered_at, %s) WHERE id IN ({marks})",
                [now, *[r[0] for r in rows]],
            )
    out = [(uuid.UUID(str(i)), k, _json(p)) for i, k, p in rows]
    return out, len(found) > limit


def keep_status(node_id: str) -> bool:
    """Renew the time to live of a node's last status (its telemetry entry); False when there is none.

    The lease keeps the status the node last sent for as long as leases
    come (the agent sends its status again when it changes, and at a floor
    interval below the time to live in any case). One cache call, that moves
    no value. A cache that cannot answer says True: asking every node for
    its status while the cache is down would only load the control plane
    with statuses it cannot keep.
    """
    return telemetry.best_effort(
        "touch", lambda: bool(cache.touch(telemetry.key(node_id), settings.LLMGW_TELEMETRY_TTL)), True
    )


def keep_statuses(node_ids: Sequence[str]) -> set[str]:
    """keep_status for many nodes at once: those whose last status is gone (one Redis round trip for all).

    For a batch of leases (agents/lease_asgi.py). A cache that cannot answer
    says every status is kept, as keep_status does.
    """
    if not node_ids:
        return set()
    ttl = cache.get_backend_timeout(settings.LLMGW_TELEMETRY_TTL)
    client = _redis_client()
    if client is None:
        return {n for n in node_ids if not keep_status(n)}

    def touch_all() -> set[str]:
        pipe = client.pipeline(transaction=False)
        for n in node_ids:
            pipe.expire(cache.make_and_validate_key(telemetry.key(n)), ttl)
        return {n for n, kept in zip(node_ids, pipe.execute(), strict=True) if not kept}

    return telemetry.best_effort("touch", touch_all, set())


def confirm_statuses(floors: Mapping[str, str]) -> set[str]:
    """The nodes of `floors` (node id: the digest its lease sent) whose last status is not the one they name.

    A status floor sent as a digest (llmgw_wire/lease.py status_digest) says
    "nothing moved past a threshold since the status of this digest": it is
    confirmed when the cache still holds that very status, and both its
    entry and its digest live on another time to live. A node whose entry is
    gone, or whose digest is another (a status this agent never had
    accepted: the cache was restored, or failed over to a replica behind),
    is asked for its whole status. One round trip for the whole batch. A
    cache that cannot answer confirms every floor, as keep_status keeps every
    status: asking the fleet for statuses it cannot keep only loads the
    control plane.
    """
    if not floors:
        return set()
    nodes = list(floors)
    entry_keys = {n: telemetry.key(n) for n in nodes}
    digest_keys = {n: telemetry.digest_key(n) for n in nodes}

    def check() -> set[str]:
        kept, digests = cache.touch_and_read(
            list(entry_keys.values()), list(digest_keys.values()), settings.LLMGW_TELEMETRY_TTL
        )
        return {n for n in nodes if entry_keys[n] not in kept or digests.get(digest_keys[n]) != floors[n]}

    return telemetry.best_effort("touch", check, set())


def _redis_client() -> Any:
    # The Redis client behind Django's cache (llmgw/cache.py), None for any other cache.
    inner = getattr(cache, "_cache", None)
    return inner.get_client(None, write=True) if hasattr(inner, "get_client") else None
