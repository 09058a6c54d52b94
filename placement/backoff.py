"""Start backoff: a deployment whose replicas keep failing to start waits longer each time.

A replica that fails before it was ever ready (a bad argument, weights
missing) will most likely fail again the same way, so the next one waits,
and keeps off the nodes where it failed again and again: until the failures
there age out of the window, or an operator clears the avoidance. A port
its agent found taken is not such a failure (the node's fact: the replica is
placed again on another port). A placement that raised is recorded on its
replica and retried after a growing wait.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q, Subquery

from llmgw_wire import shard_states
from placement import queueing, replicas
from placement.models import AvoidanceClear, Deployment, Replica, ReplicaState, Shard

log = logging.getLogger(__name__)

RS = ReplicaState
SS = shard_states.S


def backoff_s(failures: int) -> float:
    """The wait after `failures` failures: LLMGW_START_BACKOFF_BASE doubling each time, capped."""
    if failures <= 0:
        return 0.0
    base, cap = settings.LLMGW_START_BACKOFF_BASE, settings.LLMGW_START_BACKOFF_CAP
    return min(cap, base * 2 ** min(failures - 1, 30))


@dataclass(frozen=True)
class Avoidance:
    """Why a deployment keeps off a node, and until when (unless an operator clears it first)."""

    node_id: str
    failures: int
    # The last failed start's reason there: the cause an operator reads.
    last_reason: str
    last_at: dt.datetime
    # When the failures there fall below LLMGW_AVOID_AFTER within the window.
    until: dt.datetime
    why: str


@dataclass
class StartFailures:
    """A deployment's replicas that failed before ever being ready, since its last ready one, in the window."""

    count: int
    last_at: dt.datetime
    last_reason: str
    # node id -> why new replicas of this deployment keep off it.
    avoid: dict[str, str] = field(default_factory=dict)
    # node id -> the avoidance in full (cause and expiry), for operators.
    avoided: dict[str, Avoidance] = field(default_factory=dict)

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
    """Each deployment's recent failed starts and the nodes they failed on: one query, three with failures.

    A replica that fails before it was ever ready (a bad argument, weights
    missing) will most likely fail again the same way, so the next one waits
    (growing with each failure) and keeps off nodes where it failed
    LLMGW_AVOID_AFTER times. A ready replica resets the count. A port found
    taken on the node is not the deployment's failure and never counts; nor
    does a failure on a node from before an operator cleared its avoidance.
    """
    window = dt.timedelta(seconds=settings.LLMGW_START_FAILURE_WINDOW)
    since = now - window
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
        # A port its agent found taken is the node's fact: placed again on another port, not held against it.
        .exclude(Exists(Shard.objects.filter(replica_id=OuterRef("pk"), port_in_use__isnull=False)))
        .annotate(last_ready=Subquery(last_ready))
        .filter(Q(last_ready__isnull=True) | Q(updated_at__gt=F("last_ready")))
        .order_by("updated_at", "id")
        .values_list("id", "deployment_id", "updated_at", "reason")
    )
    if not failed:
        return {}
    nodes_of: dict = defaultdict(list)
    for rid, node_id in Shard.objects.filter(replica_id__in=[r[0] for r in failed], state=SS.FAILED).values_list(
        "replica_id", "node_id"
    ):
        nodes_of[rid].append(node_id)
    cleared = {
        (dep_id, node_id): at
        for dep_id, node_id, at in AvoidanceClear.objects.filter(deployment_id__in={r[1] for r in failed}).values_list(
            "deployment_id", "node_id", "at"
        )
    }
    out: dict[int, StartFailures] = {}
    per_node: dict[tuple[int, str], list[tuple[dt.datetime, str]]] = defaultdict(list)
    for rid, dep_id, at, reason in failed:
        if any(at <= cleared.get((dep_id, n), at - dt.timedelta(seconds=1)) for n in nodes_of[rid]):
            continue  # forgiven: an operator cleared the node after this failure
        h = out.get(dep_id)
        if h is None:
            out[dep_id] = StartFailures(1, at, reason)
        else:
            h.count, h.last_at, h.last_reason = h.count + 1, at, reason
        for node_id in nodes_of[rid]:
            per_node[(dep_id, node_id)].append((at, reason))
    minutes = int(settings.LLMGW_START_FAILURE_WINDOW // 60)
    need = settings.LLMGW_AVOID_AFTER
    for (dep_id, node_id), seen in per_node.items():
        n = len(seen)
        if n >= need:
            why = f"avoided: {n} failed starts here in the last {minutes} min"
            out[dep_id].avoid[node_id] = why
            out[dep_id].avoided[node_id] = Avoidance(
                node_id=node_id,
                failures=n,
                last_reason=seen[-1][1],
                last_at=seen[-1][0],
                # Fewer than `need` remain once the (n - need + 1)-th newest ages out of the window.
                until=seen[n - need][0] + window,
                why=why,
            )
    return out


def avoidances(deployment: Deployment, *, now: dt.datetime) -> list[Avoidance]:
    """The nodes a deployment keeps off now, each with its cause and expiry, by node id."""
    h = start_failures({deployment.id}, now=now).get(deployment.id)
    return [] if h is None else [h.avoided[n] for n in sorted(h.avoided)]


def clear_avoidance(
    deployment: Deployment, node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> Avoidance | None:
    """An operator clears a deployment's avoidance of a node: failed starts there so far no longer count.

    Recorded as an event with who and when (also when the node was not
    avoided, which then says so); a reconcile follows. Returns the avoidance
    that was cleared, None when there was none.
    """
    was = next((a for a in avoidances(deployment, now=now) if a.node_id == node_id), None)
    name = actor.get_username() if actor is not None else "system"
    with transaction.atomic():
        AvoidanceClear.objects.update_or_create(
            deployment=deployment, node_id=node_id, defaults={"at": now, "actor": actor, "actor_name": name}
        )
        why = (
            f"avoidance of node {node_id} cleared ({was.failures} failed starts there, last: {was.last_reason})"
            if was
            else f"avoidance of node {node_id} cleared (it was not avoided)"
        )
        replicas.event("avoidance_cleared", now=now, deployment_id=deployment.id, reason=why[:2000], actor=actor).save()
        queueing.queue_reconcile()
    return was


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
