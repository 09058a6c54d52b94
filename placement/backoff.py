"""Start backoff: a deployment whose replicas keep failing to start waits longer each time.

A replica that fails before it was ever ready (a port clash, a bad argument,
weights missing) will most likely fail again the same way, so the next one
waits, and keeps off the nodes where it failed again and again. A placement
that raised is recorded on its replica and retried after a growing wait.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import F, OuterRef, Q, Subquery

from llmgw_wire import shard_states
from placement import replicas
from placement.models import Replica, ReplicaState, Shard

log = logging.getLogger(__name__)

RS = ReplicaState
SS = shard_states.S


def backoff_s(failures: int) -> float:
    """The wait after `failures` failures: LLMGW_START_BACKOFF_BASE doubling each time, capped."""
    if failures <= 0:
        return 0.0
    base, cap = settings.LLMGW_START_BACKOFF_BASE, settings.LLMGW_START_BACKOFF_CAP
    return min(cap, base * 2 ** min(failures - 1, 30))


@dataclass
class StartFailures:
    """A deployment's replicas that failed before ever being ready, since its last ready one, in the window."""

    count: int
    last_at: dt.datetime
    last_reason: str
    # node id -> why new replicas of this deployment keep off it.
    avoid: dict[str, str] = field(default_factory=dict)

    @property
    def retry_at(self) -> dt.datetime:
        """When the next replica may be placed."""
        return self.last_at + dt.timedelta(seconds=backoff_s(self.count))

    def why(self, now: dt.datetime) -> str:
        """The reason a new replica shows while it waits."""
        wait = max(0, int((self.retry_at - now).total_seconds()))
        return (
            f"waiting {wait} s before placing again: {self.count} failed start"
            f"{'' if self.count == 1 else 's'} (last: {self.last_reason})"
        )[:2000]


def start_failures(deployment_ids: set[int], *, now: dt.datetime) -> dict[int, StartFailures]:
    """Each deployment's recent failed starts and the nodes they failed on: one query, two with failures.

    A replica that fails before it was ever ready (a port clash, a bad
    argument, weights missing) will most likely fail again the same way, so
    the next one waits (growing with each failure) and keeps off nodes where
    it failed LLMGW_AVOID_AFTER times. A ready replica resets the count.
    """
    since = now - dt.timedelta(seconds=settings.LLMGW_START_FAILURE_WINDOW)
    # The deployment's last ready replica, read per failed one in the same statement: a pass
    # with something to place pays one query here, not two.
    last_ready = (
        Replica.objects.filter(deployment_id=OuterRef("deployment_id"), ready_at__isnull=False)
        .order_by("-ready_at")
        .values("ready_at")[:1]
    )
    failed = list(
        Replica.objects.filter(
            deployment_id__in=deployment_ids, state=RS.FAILED, ready_at__isnull=True, updated_at__gte=since
        )
        .annotate(last_ready=Subquery(last_ready))
        .filter(Q(last_ready__isnull=True) | Q(updated_at__gt=F("last_ready")))
        .order_by("updated_at", "id")
        .values_list("id", "deployment_id", "updated_at", "reason")
    )
    out: dict[int, StartFailures] = {}
    for _, dep_id, at, reason in failed:
        h = out.get(dep_id)
        if h is None:
            out[dep_id] = StartFailures(1, at, reason)
        else:
            h.count, h.last_at, h.last_reason = h.count + 1, at, reason
    per_node: dict[tuple[int, str], int] = defaultdict(int)
    for dep_id, node_id in Shard.objects.filter(replica_id__in=[r[0] for r in failed], state=SS.FAILED).values_list(
        "replica__deployment_id", "node_id"
    ):
        per_node[(dep_id, node_id)] += 1
    minutes = int(settings.LLMGW_START_FAILURE_WINDOW // 60)
    for (dep_id, node_id), n in per_node.items():
        if n >= settings.LLMGW_AVOID_AFTER:
            out[dep_id].avoid[node_id] = f"avoided: {n} failed starts here in the last {minutes} min"
    return out


def placement_failed(row: Replica, exc: Exception, *, now: dt.datetime) -> None:
    """Record a placement that raised on its replica: the reason, an event, and a growing wait."""
    log.exception("placing replica %s of deployment %s failed", row.id, row.deployment_id)
    attempts = row.attempts + 1
    wait = backoff_s(attempts)
    reason = f"placement failed ({type(exc).__name__}: {exc}); next try in {wait:g} s"[:2000]
    with transaction.atomic():
        moved = Replica.objects.filter(id=row.id, state=RS.PENDING).update(
            reason=reason, attempts=attempts, not_before=now + dt.timedelta(seconds=wait), updated_at=now
        )
        if moved:
            replicas.event(
                "placement_error",
                now=now,
                deployment_id=row.deployment_id,
                replica_id=row.id,
                from_state=RS.PENDING,
                to_state=RS.PENDING,
                reason=reason,
            ).save()
    row.attempts, row.reason = attempts, reason
