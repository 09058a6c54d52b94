"""Placements written in batches: a scale-up's replicas in a few transactions, not one each.

A placement written alone costs about eleven statements and a transaction
(allocation, its GPUs, shards, commands, the replica's move and its event,
and the savepoints around them): 1,000 replicas took 8 s that way. Here a
batch of up to BATCH_SIZE planned replicas is written with one bulk insert
per table and two updates, so a thousand replicas cost a few dozen statements.

The rows are placing.placement_rows', the ones the one-replica writer
(placing.write_placement) writes too (tests/placement/test_batch_writes.py
pins it), and the database's constraints still decide: a GPU is held by one shard (AllocatedGPU's unique
constraint), a replica is moved only from the state it was read in. A batch
that breaks a constraint is rolled back and its placements written again
one by one, each in its own savepoint, so a conflict costs only the
placements that conflict; those stay pending and a pass is queued to try
them again from a fresh snapshot.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from django.db import IntegrityError, OperationalError, connection, transaction

from inventory import changes, outbox, wakeups
from inventory.models import AllocatedGPU, Allocation, Command
from placement import placing, planner, queueing
from placement.models import REPLICA_TRANSITIONS, Deployment, PlacementEvent, Replica, ReplicaState, Shard
from placement.replicas import TransitionError, event
from placement.signals import replicas_changed
from placement.snapshot import Snapshot

log = logging.getLogger(__name__)

# Placements per transaction: large enough that statements stop mattering,
# small enough that a conflict's one-by-one retry and a batch's locks stay short.
BATCH_SIZE = 250
# A pass with fewer pending replicas writes them one at a time, as before:
# a lone placement's conflict is retried in the same pass from a new snapshot.
MIN_BATCH = 2
# The replica fields a placement sets that differ replica by replica.
_VARYING = ("reason", "nvlink_domain", "fabric", "fabric_name", "endpoint", "profile_fp")


@dataclass
class Placement:
    """One planned replica's rows, computed before any is written (what write_placement writes)."""

    row: Replica
    plan: planner.Plan
    # (node id, shard id, sorted GPU indices, memory GB, cores, watts) per shard.
    claims: list[tuple[str, uuid.UUID, list[int], int, int, float]]
    shards: list[Shard]
    # (node id, kind, payload, shard key) in the order write_placement enqueues them.
    commands: list[tuple[str, str, dict[str, Any], str]]
    fields: dict[str, Any]


def _command(node_id: str, message: outbox.WireCommand, *, now: dt.datetime) -> tuple[str, str, dict[str, Any], str]:
    """A command as the outbox stores it, unsaved: (node id, kind, payload, shard key)."""
    row = outbox.unsaved(node_id, message, now=now)
    return row.node_id, row.kind, row.payload, row.shard_id


def placement_rows(
    row: Replica, dep: Deployment, result: planner.Plan, snap: Snapshot, *, now: dt.datetime
) -> Placement:
    """The rows placing `row` as `result` writes; raises as write_placement would on a bad profile or move."""
    if ReplicaState.STARTING not in REPLICA_TRANSITIONS[ReplicaState(row.state)]:
        raise TransitionError(f"a replica cannot go from {row.state} to {ReplicaState.STARTING}")
    rows = placing.placement_rows(row, dep, result, snap, now=now)
    commands = [_command(node_id, message, now=now) for node_id, message in rows.commands]
    return Placement(row, result, rows.claims, rows.shards, commands, rows.fields)


def write(batch: list[Placement], *, now: dt.datetime) -> tuple[list[Placement], list[Placement]]:
    """Write placements in the caller's transaction: (written, gone).

    `gone`: replicas no longer in the state they were read in (another pass
    placed or retired them): nothing of theirs is written. Raises
    IntegrityError when a claim collides with one already committed.
    """
    if not batch:
        return [], []
    # Locked in id order, as replicas.move does, so concurrent writers queue instead of deadlocking.
    locked = dict(
        Replica.objects.select_for_update()
        .filter(id__in=[p.row.id for p in batch])
        .order_by("id")
        .values_list("id", "state")
    )
    written = [p for p in batch if locked.get(p.row.id) == p.row.state]
    gone = [p for p in batch if locked.get(p.row.id) != p.row.state]
    if not written:
        return [], gone
    # Built afresh on each try: a rolled-back insert leaves its primary keys on the objects.
    allocs = [
        Allocation(node_id=node_id, replica_id=p.row.id, shard_id=shard_id, memory_gb=mem, cpu_cores=cores, power_w=w)
        for p in written
        for node_id, shard_id, _, mem, cores, w in p.claims
    ]
    Allocation.objects.bulk_create(allocs)
    claims = [c for p in written for c in p.claims]
    AllocatedGPU.objects.bulk_create(
        [
            AllocatedGPU(allocation=a, node_id=node_id, gpu_index=g)
            for a, (node_id, _, gpus, *_) in zip(allocs, claims, strict=True)
            for g in gpus
        ]
    )
    Shard.objects.bulk_create([_copy(s) for p in written for s in p.shards])
    Command.objects.bulk_create(
        [
            Command(node_id=node_id, kind=kind, payload=payload, created_at=now, shard_id=key)
            for p in written
            for node_id, kind, payload, key in p.commands
        ]
    )
    # What outbox.enqueue and allocation.allocate do one row at a time: the
    # agents' long-polls answer once this commits, and other processes' kept
    # placement indexes reload these nodes.
    for node_id in sorted({node_id for p in written for node_id, *_ in p.commands}):
        wakeups.publish_on_commit(node_id)
    changes.mark(node_id for node_id, *_ in claims)
    ids = [p.row.id for p in written]
    Replica.objects.filter(id__in=ids).update(state=ReplicaState.STARTING, updated_at=now, pending_reasons={})
    _set_varying(written)
    PlacementEvent.objects.bulk_create(
        [
            event(
                "state",
                now=now,
                deployment_id=p.row.deployment_id,
                replica_id=p.row.id,
                from_state=p.row.state,
                to_state=ReplicaState.STARTING,
                reason=p.fields["reason"],
            )
            for p in written
        ]
    )
    # Routers see the new replicas as soon as they are committed.
    transaction.on_commit(lambda: replicas_changed.send(sender=Replica, replica_ids=ids))
    return written, gone


def _set_varying(written: list[Placement]) -> None:
    """Each replica's own reason, endpoint and fabric: one UPDATE from a VALUES list per chunk.

    Django's bulk_update builds a CASE per field and row: for 250 replicas
    that took longer in Python than every insert of the batch together.
    """
    qn = connection.ops.quote_name
    meta = Replica._meta
    fields = [meta.get_field(n) for n in _VARYING]
    cols = ", ".join(qn(c) for c in ("pk", *(f.column for f in fields)))
    sets = ", ".join(f"{qn(f.column)} = v.{qn(f.column)}" for f in fields)
    table, pk = qn(meta.db_table), qn(meta.pk.column)
    width = len(fields) + 1
    # SQLite counts bound parameters per statement.
    per = max(1, (connection.features.max_query_params or 10_000) // width)
    for start in range(0, len(written), per):
        chunk = written[start : start + per]
        params: list[Any] = []
        for p in chunk:
            params.append(meta.pk.get_db_prep_value(p.row.id, connection))
            params += [f.get_db_prep_save(p.fields[f.name], connection) for f in fields]
        values = ", ".join(["(" + ", ".join(["%s"] * width) + ")"] * len(chunk))
        sql = f"WITH v({cols}) AS (VALUES {values}) UPDATE {table} SET {sets} FROM v WHERE {table}.{pk} = v.{qn('pk')}"
        with connection.cursor() as cur:
            cur.execute(sql, params)


def _copy(s: Shard) -> Shard:
    # A fresh instance per try, for the same reason as the allocations.
    return Shard(**{f.attname: getattr(s, f.attname) for f in Shard._meta.concrete_fields})


def _deadlock(exc: Exception) -> bool:
    return isinstance(exc, OperationalError) and "deadlock" in str(exc).lower()


class Tally(Protocol):
    """What a pass counts (reconciler.Report)."""

    placed: int
    pending: int
    conflicts: int
    errors: int


@dataclass
class BatchWriter:
    """Collects a pass's planned replicas and writes them BATCH_SIZE at a time.

    Each plan is counted in the snapshot as it is added, so the next plan in
    the pass sees its claims, as the one-at-a-time writer does after each write.
    """

    snap: Snapshot
    now: dt.datetime
    batch_size: int = BATCH_SIZE
    placed: list[Placement] = field(default_factory=list)
    conflicts: list[Placement] = field(default_factory=list)
    failed: list[tuple[Replica, Exception]] = field(default_factory=list)
    _waiting: list[Placement] = field(default_factory=list)

    def add(self, row: Replica, dep: Deployment, result: planner.Plan) -> None:
        """Plan accepted: its rows built now (a bad profile raises here, for its replica alone)."""
        self._waiting.append(placement_rows(row, dep, result, self.snap, now=self.now))
        self.snap.reserve(result)
        if len(self._waiting) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        """Write what waits: one transaction, or one savepoint each when the batch breaks a constraint."""
        batch, self._waiting = self._waiting, []
        if not batch:
            return
        try:
            with transaction.atomic():
                written, gone = write(batch, now=self.now)
        except Exception as exc:  # any refusal: each placement then answers for itself
            log.info("a batch of %d placements was refused (%s); writing them one by one", len(batch), exc)
            written, gone = [], []
            for p in batch:
                try:
                    with transaction.atomic():
                        w, g = write([p], now=self.now)
                except IntegrityError:
                    gone.append(p)
                    continue
                except Exception as one:
                    if _deadlock(one):
                        gone.append(p)
                    else:
                        self.failed.append((p.row, one))
                    continue
                written += w
                gone += g
        for p in written:
            p.row.state = ReplicaState.STARTING
            p.row.pending_reasons = {}
            for k, v in p.fields.items():
                setattr(p.row, k, v)
        self.placed += written
        self.conflicts += gone
        if gone:
            log.info("%d placements lost a race for their GPUs or replicas; left to the next pass", len(gone))

    def close(self, report: Tally) -> list[tuple[Replica, Exception]]:
        """Write the rest and correct `report` (which counted every add as placed); returns the failures.

        A conflict's replica stays pending and a pass is queued for it: the
        next one plans it from a snapshot that has the winner's claims.
        """
        self.flush()
        lost = len(self.conflicts) + len(self.failed)
        report.placed -= lost
        report.pending += lost
        report.conflicts += len(self.conflicts)
        report.errors += len(self.failed)
        if self.conflicts:
            queueing.queue_reconcile(reason=f"{len(self.conflicts)} placement conflicts")
        return self.failed
