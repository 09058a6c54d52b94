"""Giving replicas up: a failed one released at once, a planned stop drained first.

A replica that is stopped on purpose (scaled down, replaced, retired by an
operator) keeps its GPUs until its processes have ended, and its shards are
told to stop only once no router sends it requests, so a drain, a scale-down
or a rolling update fails no request. A node being drained is recorded as
drained once nothing runs on it any more.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.db.models import OuterRef, Subquery

import llmgw_wire as wire
from inventory import allocation, changes, outbox
from inventory.models import Allocation, Command, CommandKind, Node, NodeEvent, NodeState
from inventory.nodes import record_event
from llmgw_wire import shard_states
from placement import inflight, replicas
from placement.models import PlacementEvent, Replica, ReplicaState, Shard

RS = ReplicaState
SS = shard_states.S
SERVING = (RS.READY, RS.DEGRADED)
# The shard columns a pass reads for each live replica.
SHARD_FIELDS = (
    "id",
    "replica_id",
    "node_id",
    "rank",
    "state",
    "reason",
    "created_at",
    "http_port",
    "port_in_use",
    "node__state",
)


@dataclass
class LiveReplica:
    """A replica row with its shards (as value rows, ordered by rank), as a pass sees it."""

    row: Replica
    shards: list[dict[str, Any]] = field(default_factory=list)


def _stop_shards(shards: list[dict[str, Any]], *, reason: str, now: dt.datetime) -> None:
    """Cancel what was not delivered and tell the agents to stop the rest."""
    for s in shards:
        outbox.cancel_for_shard(str(s["id"]))
        if s["state"] in replicas.SHARD_DONE:
            continue
        outbox.enqueue(
            s["node_id"],
            wire.StopShard(
                shard_id=str(s["id"]), replica_id=str(s["replica_id"]), grace_s=STOP_GRACE_S, reason=reason[:2000]
            ),
            now=now,
        )


# How long a stopping replica keeps its GPUs when its agent never says its
# shards ended: the StopShard grace period and then some.
STOP_GRACE_S = 30.0
DRAIN_TIMEOUT_S = STOP_GRACE_S + 60.0


def _gone(s: dict[str, Any]) -> bool:
    """Whether a shard's process is over (or unreachable for good)."""
    return s["state"] in replicas.SHARD_DONE or s["node__state"] == NodeState.LOST


def _undelivered(shards: list[dict[str, Any]]) -> set[Any]:
    """The pending shards whose StartShard no agent has received yet, their commands locked.

    Locked, so no heartbeat marks one delivered while the caller releases it.
    A heartbeat that read one just before still hands it over: that engine is
    then a shard the control plane has written off, fenced when reported.
    """
    waiting = {str(s["id"]): s["id"] for s in shards if s["state"] == SS.PENDING}
    if not waiting:
        return set()
    found = Command.objects.select_for_update().filter(
        shard_id__in=list(waiting),
        kind=CommandKind.START_SHARD,
        acked_at__isnull=True,
        first_delivered_at__isnull=True,
    )
    return {waiting[sid] for sid in found.values_list("shard_id", flat=True) if sid in waiting}


def _release_unstarted(rep: LiveReplica, ids: set[Any], *, reason: str, now: dt.datetime) -> None:
    """Shards that never reached their agent end here, with the replica: their (node, port) is free again."""
    if not ids:
        return
    for s in rep.shards:
        if s["id"] in ids:
            outbox.cancel_for_shard(str(s["id"]))
    release_shards(
        [(s["id"], s["replica_id"]) for s in rep.shards if s["id"] in ids],
        deployment_id=rep.row.deployment_id,
        reason=f"never started: {reason}",
        now=now,
    )
    for s in rep.shards:
        if s["id"] in ids:
            s["state"] = SS.STOPPED


def release_shards(shards: list[tuple[Any, Any]], *, deployment_id: int | None, reason: str, now: dt.datetime) -> int:
    """Move these (shard id, replica id) from pending to stopped, an event each; returns how many moved.

    Compare-and-set on pending: a shard its agent reported meanwhile has a
    process to stop, and keeps its port until that process has ended.
    """
    events = []
    for sid, rid in shards:
        if Shard.objects.filter(id=sid, state=SS.PENDING).update(
            state=SS.STOPPED, reason=reason[:2000], updated_at=now
        ):
            events.append(
                replicas.event(
                    "shard_released",
                    now=now,
                    deployment_id=deployment_id,
                    replica_id=rid,
                    shard_id=sid,
                    from_state=SS.PENDING,
                    to_state=SS.STOPPED,
                    reason=reason[:2000],
                )
            )
    if events:
        PlacementEvent.objects.bulk_create(events)
        # The snapshot reads shard ports: the nodes' ports are free again.
        changes.mark(
            list(Shard.objects.filter(id__in=[e.shard_id for e in events]).values_list("node_id", flat=True)),
            holdings=True,
        )
    return len(events)


def retire(
    rep: LiveReplica, new_state: str, *, reason: str, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> bool:
    """Give a replica up whole: its shards told to stop and its allocations released.

    A planned stop (scale down, replaced) whose processes still run goes
    through DRAINING and keeps its GPUs until they have ended: an agent
    refuses to start a new shard on cards an old one still holds. A failed
    replica is released at once, so it is placed again without waiting. A
    shard whose StartShard never reached its agent has no process: it is
    stopped here, with the replica, and its port is free again at once.
    """
    serving = rep.row.state in SERVING
    with transaction.atomic():
        unstarted = _undelivered(rep.shards)
        stopping = new_state == RS.STOPPED and not all(_gone(s) or s["id"] in unstarted for s in rep.shards)
        target = RS.DRAINING if stopping else new_state
        if not replicas.change_state(rep.row, target, now=now, reason=reason, actor=actor):
            return False
        _release_unstarted(rep, unstarted, reason=reason, now=now)
        if stopping and serving:
            # Its requests finish first; stop_when_idle sends the stops.
            rep.row.updated_at = now
            stop_when_idle(rep, now=now, routers=inflight.totals())
        else:
            _stop_shards(rep.shards, reason=reason, now=now)
            if stopping:
                _mark_stop_requested(rep, now, "")
        if not stopping:
            allocation.release_replica(rep.row.id)
    return True


# Seconds a router may go on sending to a retired replica before it has
# seen the change: pushes arrive within milliseconds, a lost one is healed by
# the router's periodic refresh.
def _route_settle_s() -> float:
    return settings.LLMGW_GATEWAY_REFRESH + 2 * inflight.REPORT_TTL_S


def _mark_stop_requested(rep: LiveReplica, now: dt.datetime, why: str) -> bool:
    """Record (compare-and-set) that the replica's shards were told to stop, with an event when `why`."""
    n = Replica.objects.filter(id=rep.row.id, state=RS.DRAINING, stop_requested_at__isnull=True).update(
        stop_requested_at=now
    )
    rep.row.stop_requested_at = now
    if n and why:
        replicas.event(
            "stopping", now=now, deployment_id=rep.row.deployment_id, replica_id=rep.row.id, reason=why
        ).save()
    return bool(n)


def stop_when_idle(rep: LiveReplica, *, now: dt.datetime, routers: inflight.Totals) -> bool:
    """Tell a retiring replica's shards to stop once no router sends it requests; True when told.

    The routers stop choosing it as soon as they see it draining; its shards
    are stopped only when the requests already in flight to it have finished
    (or LLMGW_DRAIN_REQUESTS_TIMEOUT passes), so a drain, a scale-down or a
    rolling update fails no request. With no router alive, nothing is in
    flight and it stops at once; with the routers' reports unreadable, it
    waits out the timeout.
    """
    waited = (now - rep.row.updated_at).total_seconds()
    busy = routers.per_replica.get(str(rep.row.id), 0)
    timeout = settings.LLMGW_DRAIN_REQUESTS_TIMEOUT
    if not routers.known:
        # The routers' reports are unreadable (Redis down): requests may still run there, so the
        # replica waits as long as requests that never end would, and the pass goes on meanwhile.
        if waited < timeout:
            return False
        why = f"in-flight requests unknown (reports unreadable) after {waited:.0f} s"
    elif routers.routers and (waited < min(_route_settle_s(), timeout) or (busy and waited < timeout)):
        return False
    else:
        why = f"{busy} requests still in flight after {waited:.0f} s" if busy else "no requests in flight"
    with transaction.atomic():
        if not _mark_stop_requested(rep, now, why):
            return False
        _stop_shards(rep.shards, reason=rep.row.reason or why, now=now)
    return True


def drain_done(rep: LiveReplica, now: dt.datetime) -> str:
    """Why a draining replica is finished ("" while its processes may still run)."""
    if all(_gone(s) for s in rep.shards):
        return "all shards stopped"
    if (now - (rep.row.stop_requested_at or rep.row.updated_at)).total_seconds() > DRAIN_TIMEOUT_S:
        return f"shards not reported stopped within {DRAIN_TIMEOUT_S:g} s; released"
    return ""


def release_leftover_shards(*, now: dt.datetime, limit: int = 500) -> int:
    """Stop the pending shards of replicas that are over, once nothing can start them any more; returns how many.

    A replica retired before its StartShard reached the agent is released with
    it (retire); this catches what slipped past: a StartShard delivered in an
    answer the agent never got, then cancelled, or a replica released after
    its drain timed out. Such a shard is pending for ever, and its (node,
    port) with it. Swept once no command about it waits for its agent and its
    replica ended STOP_GRACE_S ago: an agent that had started it was told to
    stop it, and says so in the heartbeat that acknowledges the stop.
    """
    settled = now - dt.timedelta(seconds=STOP_GRACE_S)
    rows = list(
        Shard.objects.filter(
            state=SS.PENDING,
            replica__state__in=[RS.STOPPED, RS.FAILED],
            replica__updated_at__lt=settled,
        )
        .order_by("created_at")
        .values_list("id", "replica_id", "replica__deployment_id")[:limit]
    )
    if not rows:
        return 0
    # Read apart, not joined: commands name their shard by its id's text, which a UUID column
    # cast to text spells differently from one database to another.
    waiting = set(
        Command.objects.filter(shard_id__in=[str(r[0]) for r in rows], acked_at__isnull=True).values_list(
            "shard_id", flat=True
        )
    )
    rows = [r for r in rows if str(r[0]) not in waiting]
    by_dep: dict[int, list[tuple[Any, Any]]] = {}
    for sid, rid, dep in rows:
        by_dep.setdefault(dep, []).append((sid, rid))
    moved = 0
    with transaction.atomic():
        for dep, shards in by_dep.items():
            moved += release_shards(
                shards, deployment_id=dep, reason="never started; released after its replica ended", now=now
            )
    return moved


def finish_drains(*, now: dt.datetime) -> list[str]:
    """Record "drained" on draining nodes that nothing runs on any more.

    The node stays draining: the operator decides when it comes back
    (uncordon), after maintenance. Recorded once per drain.
    """
    last = NodeEvent.objects.filter(node=OuterRef("pk"), kind__in=["state", "drained"]).order_by("-at", "-id")
    busy_alloc = Allocation.objects.filter(node=OuterRef("pk")).values("id")[:1]
    busy_shard = (
        Shard.objects.filter(node=OuterRef("pk"), replica__state__in=replicas.LIVE_STATES)
        .exclude(state__in=replicas.SHARD_DONE)
        .values("id")[:1]
    )
    rows = (
        Node.objects.filter(state=NodeState.DRAINING)
        .annotate(
            last_kind=Subquery(last.values("kind")[:1]),
            alloc=Subquery(busy_alloc),
            shard=Subquery(busy_shard),
        )
        .filter(alloc__isnull=True, shard__isnull=True)
        .exclude(last_kind="drained")
        .values_list("id", flat=True)
    )
    done = []
    for node_id in rows:
        record_event(node_id, "drained", "no replicas left; uncordon to use it again", now=now)
        done.append(node_id)
    return done


def retire_replica(
    replica_id: Any, *, now: dt.datetime, actor: AbstractBaseUser | None = None, reason: str = ""
) -> bool:
    """An operator gives a replica up: stopped whole, as a scale-down stops one.

    Its shards are told to stop and its GPUs kept until they have ended (an
    agent refuses new work on cards an old process still holds); the next
    pass places a new replica if the deployment still wants as many. False
    when the replica is not live any more (already retired, stopped or failed).
    """
    row = Replica.objects.filter(id=replica_id, state__in=replicas.LIVE_STATES - {RS.DRAINING}).first()
    if row is None:
        return False
    rep = LiveReplica(row)
    rep.shards = sorted(
        Shard.objects.filter(replica_id=row.id).values(*SHARD_FIELDS),
        key=lambda s: s["rank"],
    )
    who = getattr(actor, "username", "") or "an operator"
    why = f"retired by {who}" + (f": {reason}" if reason else "")
    return retire(rep, RS.STOPPED, reason=why, now=now, actor=actor)
