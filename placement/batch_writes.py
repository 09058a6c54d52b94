"""Placements written in batches: a scale-up's replicas in a few transactions, not one each.

A placement written in its own transaction costs a few statements and a
commit; 1,000 replicas took seconds that way. Here a batch of up to
BATCH_SIZE planned replicas is written with the same statements
(placement/writes.py: three or four, whatever the number of placements),
so a thousand replicas cost a few dozen statements.

The rows are the ones the one-replica writer (placing.write_placement)
writes too (tests/placement/test_batch_writes.py pins it), and the
database's constraints still decide: a GPU is held by one shard
(AllocatedGPU's unique constraint), a replica is moved only from the state
it was read in. A batch that breaks a constraint is rolled back and its
placements written again one by one, each in its own savepoint, so a
conflict costs only the placements that conflict; those stay pending and a
pass is queued to try them again from a fresh snapshot.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Protocol

from django.db import IntegrityError, OperationalError, transaction

from placement import planner, queueing
from placement.models import Deployment, Replica, ReplicaState
from placement.snapshot import Snapshot
from placement.writes import Placement, placement_rows, write

log = logging.getLogger(__name__)

# Placements per transaction: large enough that statements stop mattering,
# small enough that a conflict's one-by-one retry and a batch's locks stay short.
BATCH_SIZE = 250
# A pass with fewer pending replicas writes them one at a time, as before:
# a lone placement's conflict is retried in the same pass from a new snapshot.
MIN_BATCH = 2


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
            # WARNING, not INFO: one by one, a batch of 250 is seconds of the pass, and the replicas after it wait.
            log.warning("a batch of %d placements was refused (%s); writing them one by one", len(batch), exc)
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
