"""What agents tell placement: shards found running at registration, and shard states at heartbeats.

A node may only speak about its own shards: every lookup is filtered by the
authenticated node, so a report naming another node's shard changes nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from django.db import connection
from django.db.models import QuerySet

import llmgw_wire as wire
from inventory import outbox
from inventory.models import Command, CommandKind
from llmgw.db import prepared_cursor
from llmgw_wire import shard_states
from placement.models import PlacementEvent, Replica, ReplicaState, Shard

log = logging.getLogger(__name__)

# The state machine's sets, under the names this module has always used.
TERMINAL = shard_states.TERMINAL
LIVE = shard_states.LIVE
FENCEABLE = shard_states.FENCEABLE
MAX_REASON = 512
UNKNOWN = "shard unknown to the control plane"
GONE_REPLICA = frozenset({ReplicaState.STOPPED, ReplicaState.FAILED})


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def allowed(old: str, new: str) -> bool:
    """Whether an agent's report may move a shard from `old` to `new`: the state machine's rule."""
    return shard_states.allowed(old, new)


@dataclass
class SyncResult:
    """What a registration's or heartbeat's shard report did."""

    adopted: list[str] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # (shard id, from, to)
    failed_missing: list[str] = field(default_factory=list)
    # The node's pending commands, when read with the shards.
    pending: list[outbox.PendingCommand] | None = None


def _fence(node_id: str, reported: list[tuple[str, str, str, str]], result: SyncResult, *, now: dt.datetime) -> int:
    """Queue a StopShard for each (shard id, replica id, reason, reported state) that is FENCEABLE.

    None is queued for a shard that already has one pending. Returns how many were queued.
    """
    targets = [t[:3] for t in reported if t[3] in FENCEABLE]
    if not targets:
        return 0
    queued = 0
    key_len = outbox.SHARD_KEY_LEN
    already = set(
        Command.objects.filter(
            node_id=node_id,
            kind=CommandKind.STOP_SHARD,
            acked_at__isnull=True,
            shard_id__in=[t[0][:key_len] for t in targets],
        ).values_list("shard_id", flat=True)
    )
    for shard_id, replica_id, reason in targets:
        result.fenced.append(shard_id)
        if shard_id[:key_len] in already:
            continue
        already.add(shard_id[:key_len])
        message = wire.StopShard(shard_id=shard_id, replica_id=replica_id, reason=reason[:MAX_REASON])
        outbox.enqueue(node_id, message, now=now)
        queued += 1
    return queued


def _set_states(
    changes: list[tuple[ShardRow, str, str, int | None, str]],
    *,
    now: dt.datetime,
    actor: str,
    tails: dict[uuid.UUID, str] | None = None,
    taken: dict[uuid.UUID, int] | None = None,
) -> list:
    """Compare-and-set each shard's state; an event row for each that moved. Returns the moves made.

    `tails`: the end of the engine's output, by shard id, for shards the agent reported failed;
    `taken`: the port the agent found in use, by shard id, for shards that failed on it.
    """
    events = []
    moved = []
    for row, new, reason, exit_code, kind in changes:
        output: dict = {"output_tail": tails[row.id]} if tails and row.id in tails else {}
        if taken and row.id in taken:
            output["port_in_use"] = taken[row.id]
        n = Shard.objects.filter(id=row.id, state=row.state).update(
            state=new, reason=reason, exit_code=exit_code, updated_at=now, **output
        )
        if not n:
            # Someone else moved it first; their move stands.
            continue
        moved.append((str(row.id), row.state, new))
        events.append(
            PlacementEvent(
                at=now,
                deployment_id=row.deployment_id,
                replica_id=row.replica_id,
                shard_id=row.id,
                kind=kind,
                from_state=row.state,
                to_state=new,
                reason=reason,
                actor_name=actor,
            )
        )
    if events:
        PlacementEvent.objects.bulk_create(events)
    return moved


class ShardRow(NamedTuple):
    """One shard of a node as the control plane holds it, with its replica's deployment and state."""

    id: uuid.UUID
    state: str
    reason: str
    exit_code: int | None
    replica_id: uuid.UUID
    deployment_id: int
    replica_state: str


# The ORM's names of ShardRow's fields, in order.
_ROW_FIELDS = ("id", "state", "reason", "exit_code", "replica_id", "replica__deployment_id", "replica__state")


def _orm_rows(shards: QuerySet) -> list[ShardRow]:
    return [ShardRow(*values) for values in shards.values_list(*_ROW_FIELDS)]


@dataclass
class NodeRead:
    """What one read found of a node: the shards asked about, and its pending commands when asked for them."""

    shards: dict[uuid.UUID, ShardRow]
    # None when not read.
    pending: list[outbox.PendingCommand] | None


def read_shards(node_id: str, ids: list[uuid.UUID], *, pending_limit: int | None = None) -> NodeRead:
    """The node's rows of these shards, and with pending_limit (PostgreSQL) its pending commands in the same statement.

    Hand-written SQL: this read runs on every heartbeat that lists shards,
    and the pending commands riding along spare the heartbeat a round trip.
    """
    shard, replica, command = Shard._meta.db_table, Replica._meta.db_table, Command._meta.db_table
    pk = Shard._meta.pk
    columns = "s.id, s.state, s.reason, s.exit_code, s.replica_id, r.deployment_id, r.state"
    source = f"{shard} s JOIN {replica} r ON r.id = s.replica_id WHERE s.node_id = %s AND s.id "
    if connection.vendor != "postgresql":
        # Portable: the ids adapted as the backend stores them, one placeholder each.
        values = [pk.get_db_prep_value(i, connection) for i in ids]
        sql = f"SELECT {columns} FROM {source}IN ({', '.join(['%s'] * len(values))})"
        params: list = [node_id, *values]
        pending_limit = None
    elif pending_limit is None:
        # One statement whatever the number of shards, so PostgreSQL prepares it once (llmgw/db.py).
        sql, params = f"SELECT {columns} FROM {source}= ANY(%s)", [node_id, list(ids)]
    else:
        # One round trip for both reads: each row says which it answers (0: a shard, 1: a command, in
        # queue order); a command's payload stands beside a shard's state.
        commands_sql = (
            "SELECT 1, row_number() OVER (ORDER BY created_at, id), id, kind, payload, NULL, NULL, NULL, NULL, NULL "
            f"FROM {command} WHERE node_id = %s AND acked_at IS NULL ORDER BY created_at, id LIMIT %s"
        )
        shard_columns = "s.id, s.state, NULL::jsonb, s.reason, s.exit_code, s.replica_id, r.deployment_id, r.state"
        sql = f"SELECT 0, 0, {shard_columns} FROM {source}= ANY(%s) UNION ALL ({commands_sql}) ORDER BY 1, 2"
        params = [node_id, list(ids), node_id, pending_limit]
    read = NodeRead(shards={}, pending=None if pending_limit is None else [])
    with prepared_cursor() as cur:
        cur.execute(sql, params)
        for row in cur.fetchall():
            if read.pending is not None:
                part, _, *row = row
                if part == 1:
                    read.pending.append(outbox.PendingCommand(row[0], row[1], row[2]))
                    continue
                del row[2]
            found = ShardRow(*row)
            found = found._replace(id=pk.to_python(found.id), replica_id=pk.to_python(found.replica_id))
            read.shards[found.id] = found
    return read


def fence_reason(row: ShardRow | None, reported: wire.ShardState, *, at_registration: bool) -> str | None:
    """Why a shard an agent reports must be stopped, or None when the control plane keeps it.

    The one classification of reported shards, for heartbeats and
    registrations alike: unknown to the control plane, or written off by it
    (its replica released or deleted, or the shard itself over). At a
    heartbeat only a shard reported alive is worth fencing, and a replica's
    state is the reconciler's to act on; a registration fences all of it.
    """
    if row is None:
        return UNKNOWN
    if at_registration:
        if row.replica_state in GONE_REPLICA:
            return f"replica is {row.replica_state}"
        if row.state in TERMINAL:
            return f"shard is {row.state}: {row.reason}"
        return None
    if row.state in TERMINAL and reported in LIVE:
        return f"shard is {row.state} in the control plane: {row.reason}"
    return None


def failure(status: wire.ShardStatus) -> tuple[str, str]:
    """A failed shard's reason, naming the cause from its engine's output, and that output's end to store.

    Both redacted and bounded again here: an older agent sent its log's end
    as it was, and named no cause ("the engine exited with code 1"), so the
    cause line is added from the tail unless the reason names it already.
    """
    tail = wire.bounded_tail(status.log_tail)
    return wire.with_cause(wire.redact(status.reason), tail), "\n".join(tail)


def record_shard_states(
    node_id: str, statuses: Iterable[wire.ShardStatus], *, now: dt.datetime, pending_limit: int | None = None
) -> SyncResult:
    """Record the shard states a heartbeat reports; fence what should no longer run.

    One read for all of them; a write only for a shard whose state, reason or
    exit code changed, and an event for each change of state. An unknown state
    was already read as failed by the wire schema. A shard reported alive that
    the control plane has written off (failed after its node was lost, its
    replica released or deleted) gets a StopShard: that is the fence after a
    node comes back from a partition without restarting its agent. A shard
    reported failed keeps the end of its engine's output, and its reason names
    the cause (failure).

    With pending_limit, the read of the shards also reads the node's pending
    commands (read_shards): result.pending, None when
    not read or when a fence queued one since (read them again).
    """
    result = SyncResult()
    reports = {}
    for s in statuses:
        sid = _uuid(s.shard_id)
        if sid is not None:
            reports[sid] = s
    if not reports:
        return result
    read = read_shards(node_id, list(reports), pending_limit=pending_limit)
    result.pending = read.pending
    changes = []
    tails: dict[uuid.UUID, str] = {}
    taken: dict[uuid.UUID, int] = {}
    fence = []
    for sid, s in reports.items():
        row = read.shards.get(sid)
        state = wire.ShardState(s.state)
        why = fence_reason(row, state, at_registration=False)
        if why is not None:
            fence.append((str(sid), s.replica_id if row is None else str(row.replica_id), why, state))
            continue
        old = row.state
        if allowed(old, state) and state == wire.ShardState.FAILED:
            reason, tails[sid] = failure(s)
            if s.port_in_use is not None:
                taken[sid] = s.port_in_use
            changes.append((row, str(state), reason, s.exit_code, "shard_state"))
        elif allowed(old, state):
            changes.append((row, str(state), s.reason, s.exit_code, "shard_state"))
        elif old == state and (s.reason != row.reason or s.exit_code != row.exit_code) and old not in TERMINAL:
            # Same state, new detail (a loading shard's progress): the row, no event.
            Shard.objects.filter(id=sid, state=old).update(reason=s.reason, exit_code=s.exit_code, updated_at=now)
    result.changed = _set_states(changes, now=now, actor="agent", tails=tails, taken=taken)
    if _fence(node_id, fence, result, now=now):
        # A command queued after the read: read them again.
        result.pending = None
    return result


def adopt_running(
    node_id: str, running: Iterable[wire.RunningShard], *, now: dt.datetime, new_node: bool = False
) -> SyncResult:
    """At registration: adopt the shards the control plane knows, fence the rest, fail what vanished.

    A known shard of a live replica, placed on this node, is adopted as it
    runs, with the state the agent reports (no restart: a model takes minutes
    to load). A shard this control plane does not know, one placed elsewhere,
    one it has written off, or one whose replica is gone or stopped gets a
    StopShard: after a node comes back from lost, its old processes would
    otherwise hold GPUs the planner has given away. A shard the control plane
    thinks runs here but the agent does not report is dead, unless its
    StartShard is still waiting for the agent.

    `new_node`: the node's row was inserted in this transaction, so no shard
    can be placed on it yet (a shard's node is a foreign key) and its shards
    are not read: under a join storm that is a statement fewer a node.
    """
    result = SyncResult()
    reports: dict[uuid.UUID, wire.RunningShard] = {}
    fence = []
    for r in running:
        sid = _uuid(r.shard_id)
        if sid is None:
            # Not even a shard id of ours: stop it under the name the agent gave.
            fence.append((r.shard_id, r.replica_id, UNKNOWN, wire.ShardState(r.state)))
        else:
            reports[sid] = r
    rows = {} if new_node else {row.id: row for row in _orm_rows(Shard.objects.filter(node_id=node_id))}
    changes = []
    for sid, r in reports.items():
        row = rows.get(sid)
        state = wire.ShardState(r.state)
        why = fence_reason(row, state, at_registration=True)
        if why is not None:
            fence.append((str(sid), r.replica_id if row is None else str(row.replica_id), why, state))
        else:
            result.adopted.append(str(sid))
            if row.state != state:
                changes.append((row, str(state), "adopted at registration", None, "adopted"))
    # Known live shards the agent did not report.
    missing = [
        row for sid, row in rows.items() if sid not in reports and row.state in (LIVE - {shard_states.S.PENDING})
    ]
    if missing:
        waiting = set(
            Command.objects.filter(
                node_id=node_id,
                kind=CommandKind.START_SHARD,
                acked_at__isnull=True,
                shard_id__in=[str(r.id) for r in missing],
            ).values_list("shard_id", flat=True)
        )
        for row in missing:
            if str(row.id) not in waiting:
                changes.append(
                    (row, wire.ShardState.FAILED.value, "not running when the agent registered", None, "shard_state")
                )
                result.failed_missing.append(str(row.id))
    result.changed = _set_states(changes, now=now, actor="agent")
    _fence(node_id, fence, result, now=now)
    return result


def fail_node_shards(node_id: str, *, reason: str, now: dt.datetime) -> list[str]:
    """Mark every shard of a node that is not over as failed (the node is lost); returns their ids.

    The reconciler then releases those replicas whole and rebuilds them: one
    dead shard makes the others useless.
    """
    rows = _orm_rows(Shard.objects.filter(node_id=node_id).exclude(state__in=TERMINAL))
    moved = _set_states(
        [(row, wire.ShardState.FAILED.value, reason, None, "shard_state") for row in rows], now=now, actor="system"
    )
    return [m[0] for m in moved]
