"""Placing a replica: plan it over a snapshot, then write it whole in one transaction.

Allocations, shard rows and StartShard commands are written together, so a
replica is placed whole or not at all; the database's one-shard-per-GPU
constraint makes a second reconciler racing for the same cards roll back,
never double-book.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import TYPE_CHECKING

from django.db import IntegrityError, OperationalError, transaction

from placement import planner, writes
from placement.models import Deployment, Replica, ReplicaState
from placement.signals import replicas_changed
from placement.snapshot import Snapshot

if TYPE_CHECKING:
    from placement.batch_writes import BatchWriter

log = logging.getLogger(__name__)

RS = ReplicaState


def place(
    row: Replica,
    dep: Deployment,
    snap: Snapshot,
    refused: dict[int, planner.NoPlace],
    *,
    now: dt.datetime,
    avoid: dict[str, str] | None = None,
    batch: BatchWriter | None = None,
) -> str:
    """Plan one pending replica and write it whole; "placed", "pending" or "conflict".

    With a `batch`, the plan is added to it, written when it fills or closes ("placed" meanwhile).

    `refused` keeps each deployment's refusal over this snapshot: planning is
    pure, so a second replica of it would be refused alike, node by node.
    """
    result = refused.get(dep.id)
    if result is None:
        req = planner.ReplicaRequest.from_profile(dep.profile, selector=dep.node_selector, avoid=avoid)
        result = planner.plan(req, snap, policy=dep.policy)
    if isinstance(result, planner.NoPlace):
        refused[dep.id] = result
        reasons = dict(list(result.reasons.items())[:500])
        if row.reason != result.reason or row.pending_reasons != reasons:
            Replica.objects.filter(id=row.id, state=RS.PENDING).update(
                reason=result.reason, pending_reasons=reasons, updated_at=now
            )
            row.reason, row.pending_reasons = result.reason, reasons
            # The gateways answer requests held for this model at once with the planner's reason.
            ids = [row.id]
            transaction.on_commit(lambda: replicas_changed.send(sender=Replica, replica_ids=ids))
        return "pending"
    if batch is not None:
        batch.add(row, dep, result)
        return "placed"
    try:
        with transaction.atomic():
            write_placement(row, dep, result, snap, now=now)
    except IntegrityError:
        log.info("replica %s lost a race for its GPUs; retrying", row.id)
        return "conflict"
    except OperationalError as e:
        # Two writers waiting on each other's cards: the database picks one to lose.
        if "deadlock" not in str(e).lower():
            raise
        log.info("replica %s deadlocked with another placement; retrying", row.id)
        return "conflict"
    snap.reserve(result)
    return "placed"


def write_placement(row: Replica, dep: Deployment, result: planner.Plan, snap: Snapshot, *, now: dt.datetime) -> None:
    """Allocations, shard rows, StartShard commands and the replica's move, in the caller's transaction."""
    written, _ = writes.write([writes.placement_rows(row, dep, result, snap, now=now)], now=now)
    if not written:
        # Someone else moved it meanwhile (another pass placed it): nothing of ours is written.
        raise IntegrityError(f"replica {row.id} is no longer pending")
    placed = written[0]
    row.state, row.pending_reasons = RS.STARTING, {}
    for k, v in placed.fields.items():
        setattr(row, k, v)
