"""The command outbox: what the control plane wants each agent to do, delivered in heartbeat answers.

Callers enqueue inside their own transaction, so a command exists exactly
when the decision that made it was committed (the reconciler writes
allocations and StartShard commands together).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterable
from typing import Any, NamedTuple

from django.db.models import F, Value
from django.db.models.functions import Coalesce

import llmgw_wire as wire
from inventory import wakeups
from inventory.models import Command, CommandKind
from llmgw.db import prepared_cursor

# Command.shard_id's width: the key a command is found by (a shard id of ours is a UUID).
SHARD_KEY_LEN = 64

WireCommand = wire.StartShard | wire.StopShard | wire.ScanFabric | wire.InstallEngine


def columns(message: WireCommand) -> tuple[str, dict[str, Any], str]:
    """What the outbox stores of a command: its kind, payload and the key it is found by (its shard's id)."""
    payload = message.model_dump(mode="json", exclude={"id"})
    return message.kind, payload, str(getattr(message, "shard_id", "") or "")[:SHARD_KEY_LEN]


def unsaved(node_id: str, message: WireCommand, *, now: dt.datetime) -> Command:
    """A command as the outbox stores it, not yet saved."""
    kind, payload, shard_id = columns(message)
    return Command(node_id=node_id, kind=kind, payload=payload, created_at=now, shard_id=shard_id)


def enqueue(node_id: str, message: WireCommand, *, now: dt.datetime) -> Command:
    """Queue a command for a node; its id is assigned here."""
    wakeups.publish_on_commit(node_id)  # the agent's long-poll answers once this commits
    command = unsaved(node_id, message, now=now)
    command.save(force_insert=True)
    return command


class PendingCommand(NamedTuple):
    """A pending command as read from the outbox: its id, kind and payload (JSON text or decoded)."""

    id: Any
    kind: str
    payload: Any


def pending_rows(node_id: str, *, limit: int = wire.MAX_COMMANDS) -> list[PendingCommand]:
    """A node's pending commands, oldest first, as read (none marked delivered)."""
    # Hand-written SQL: every heartbeat asks, and most find nothing.
    with prepared_cursor() as cur:
        cur.execute(
            f"SELECT id, kind, payload FROM {Command._meta.db_table} "
            "WHERE node_id = %s AND acked_at IS NULL ORDER BY created_at, id LIMIT %s",
            [node_id, limit],
        )
        return [PendingCommand(*row) for row in cur.fetchall()]


def pending(
    node_id: str,
    *,
    now: dt.datetime,
    limit: int = wire.MAX_COMMANDS,
    rows: list[PendingCommand] | None = None,
) -> list[WireCommand]:
    """The unacknowledged commands for a node, oldest first, as wire messages.

    Marks them delivered; they stay pending until acknowledged. `rows` are
    the node's pending commands when the caller read them already, in the
    same transaction (placement/agent_sync.py reads them with the shards).
    """
    if rows is None:
        rows = pending_rows(node_id, limit=limit)
    if not rows:
        return []
    found = [
        Command(
            id=uuid.UUID(str(r.id)),
            kind=r.kind,
            payload=json.loads(r.payload) if isinstance(r.payload, str) else r.payload,
        )
        for r in rows
    ]
    ids = [r.id for r in found]
    # One statement: a heartbeat's cost must not grow with its commands.
    Command.objects.filter(id__in=ids).update(
        deliveries=F("deliveries") + 1, first_delivered_at=Coalesce(F("first_delivered_at"), Value(now))
    )
    return [to_wire(r) for r in found]


def to_wire(row: Command) -> WireCommand:
    """A queued command as the wire message the agent receives."""
    adapter = {
        "start_shard": wire.StartShard,
        "stop_shard": wire.StopShard,
        "scan_fabric": wire.ScanFabric,
        "install_engine": wire.InstallEngine,
    }[row.kind]
    return adapter.model_validate({**row.payload, "id": str(row.id), "kind": row.kind})


def acknowledge(node_id: str, ids: Iterable[str], *, now: dt.datetime) -> int:
    """Mark a node's commands as applied. Ids of other nodes' commands are ignored."""
    valid = []
    for i in ids:
        try:
            valid.append(str(uuid.UUID(str(i))))
        except ValueError:
            continue
    if not valid:
        return 0
    return Command.objects.filter(node_id=node_id, id__in=valid, acked_at__isnull=True).update(acked_at=now)


def claim_scan(node_id: str, command_id: str, key: str, *, hca: str, port: int, now: dt.datetime) -> str:
    """Use up the ScanFabric command a scan upload answers; returns why it may not, or "" when it may.

    A node credential may write a fabric's map only when this node was asked
    to scan that fabric, on that port, and only once: otherwise any node could
    replace any fabric's map, or fill the table with keys nobody asked about.
    """
    try:
        cid = uuid.UUID(str(command_id))
    except ValueError:
        return "a scan upload must name the scan command it answers (command_id)"
    cmd = Command.objects.select_for_update().filter(id=cid, node_id=node_id, kind=CommandKind.SCAN_FABRIC).first()
    if cmd is None:
        return "no scan was asked of this node under that command id"
    if cmd.acked_at is not None:
        return "this scan command was already answered"
    asked = cmd.payload
    if asked.get("key") != key:
        return "the scan command was for another fabric key"
    if hca and (asked.get("hca") != hca or int(asked.get("port", 1)) != port):
        return "the scan command was for another port"
    cmd.acked_at = now
    cmd.save(update_fields=["acked_at"])
    return ""


def cancel_for_shard(shard_id: str) -> int:
    """Drop unacknowledged commands about a shard nobody wants any more."""
    deleted, _ = Command.objects.filter(shard_id=str(shard_id), acked_at__isnull=True).delete()
    return deleted
