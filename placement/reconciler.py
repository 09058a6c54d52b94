"""The reconciler: make the running replicas what the deployments ask for, and keep them so.

One pass, given `now`:
1. each live replica's state follows its shards (ready when all are; a failed
   shard or a lost node fails it, and it is released whole and placed again);
2. a replica whose replacement is ready is stopped (drains and profile rolls
   start the new replica first, so ready capacity never dips);
3. replicas on draining nodes get replacements; a changed profile rolls one
   replica at a time per deployment;
4. deployments are scaled up (new pending replicas) and down;
5. pending replicas are placed: allocations, shard rows and StartShard
   commands in one transaction per replica, so a replica is placed whole or
   not at all; the database's one-shard-per-GPU constraint makes a second
   reconciler racing for the same cards roll back, never double-book;
6. a draining node with nothing left on it is recorded as drained.

Steady state (nothing to change) costs a constant number of queries.
Paused deployments are left alone entirely.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import IntegrityError, OperationalError, transaction
from django.db.models import Max, OuterRef, Subquery

import wire
from agents import commands
from inventory import allocation, changes
from inventory.models import Allocation, Node, NodeEvent, NodeState
from inventory.nodes import record_event
from placement import inflight, kept, planner, replicas
from placement import snapshot as snapshots
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, ReplicaState, Shard
from wire import shard_states

log = logging.getLogger(__name__)

RS = ReplicaState
SS = shard_states.S
SERVING = (RS.READY, RS.DEGRADED)


@dataclass
class Report:
    """What one pass did, for logs, tests and benchmarks."""

    created: int = 0
    placed: int = 0
    pending: int = 0
    ready: int = 0
    failed: int = 0
    stopped: int = 0
    conflicts: int = 0
    # Pending replicas left for later: waiting out a backoff, or whose placement raised.
    backing_off: int = 0
    errors: int = 0
    orphans_released: int = 0
    drained: list[str] = field(default_factory=list)


@dataclass
class _Replica:
    row: Replica
    shards: list[dict[str, Any]] = field(default_factory=list)


def _stop_shards(shards: list[dict[str, Any]], *, reason: str, now: dt.datetime) -> None:
    """Cancel what was not delivered and tell the agents to stop the rest."""
    for s in shards:
        commands.cancel_for_shard(str(s["id"]))
        if s["state"] in replicas.SHARD_DONE:
            continue
        commands.enqueue(
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


def retire(
    rep: _Replica, new_state: str, *, reason: str, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> bool:
    """Give a replica up whole: its shards told to stop and its allocations released.

    A planned stop (scale down, replaced) whose processes still run goes
    through DRAINING and keeps its GPUs until they have ended: an agent
    refuses to start a new shard on cards an old one still holds. A failed
    replica is released at once, so it is placed again without waiting.
    """
    stopping = new_state == RS.STOPPED and not all(_gone(s) for s in rep.shards)
    serving = rep.row.state in SERVING
    with transaction.atomic():
        target = RS.DRAINING if stopping else new_state
        if not replicas.change_state(rep.row, target, now=now, reason=reason, actor=actor):
            return False
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


def _mark_stop_requested(rep: _Replica, now: dt.datetime, why: str) -> bool:
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


def stop_when_idle(rep: _Replica, *, now: dt.datetime, routers: inflight.Totals) -> bool:
    """Tell a retiring replica's shards to stop once no router sends it requests; True when told.

    The routers stop choosing it as soon as they see it draining; its shards
    are stopped only when the requests already in flight to it have finished
    (or LLMGW_DRAIN_REQUESTS_TIMEOUT passes), so a drain, a scale-down or a
    rolling update fails no request. With no router alive, nothing is in
    flight and it stops at once.
    """
    waited = (now - rep.row.updated_at).total_seconds()
    busy = routers.per_replica.get(str(rep.row.id), 0)
    if routers.routers:
        timeout = settings.LLMGW_DRAIN_REQUESTS_TIMEOUT
        if waited < min(_route_settle_s(), timeout) or (busy and waited < timeout):
            return False
    why = f"{busy} requests still in flight after {waited:.0f} s" if busy else "no requests in flight"
    with transaction.atomic():
        if not _mark_stop_requested(rep, now, why):
            return False
        _stop_shards(rep.shards, reason=rep.row.reason or why, now=now)
    return True


def _drained(rep: _Replica, now: dt.datetime) -> str:
    """Why a draining replica is finished ("" while its processes may still run)."""
    if all(_gone(s) for s in rep.shards):
        return "all shards stopped"
    if (now - (rep.row.stop_requested_at or rep.row.updated_at)).total_seconds() > DRAIN_TIMEOUT_S:
        return f"shards not reported stopped within {DRAIN_TIMEOUT_S:g} s; released"
    return ""


def _health(rep: _Replica, profile: EngineProfile, now: dt.datetime) -> tuple[str, str] | None:
    """The state a live, placed replica should be in by its shards, and why; None to stay."""
    state = rep.row.state
    if not rep.shards:
        return None
    for s in rep.shards:
        where = f"shard {s['rank']} on {s['node_id']}"
        if s["node__state"] == NodeState.LOST:
            return RS.FAILED, f"node {s['node_id']} lost"
        if s["state"] == SS.FAILED:
            return RS.FAILED, f"{where} failed" + (f": {s['reason']}" if s["reason"] else "")
        if s["state"] in (SS.STOPPED, SS.DRAINING) and state != RS.DRAINING:
            return RS.FAILED, f"{where} {s['state']} unasked"
    all_ready = all(s["state"] == SS.READY for s in rep.shards)
    if state == RS.STARTING:
        if all_ready:
            return RS.READY, "all shards ready"
        started = min(s["created_at"] for s in rep.shards)
        if (now - started).total_seconds() > profile.startup_timeout_s:
            return RS.FAILED, f"not ready within the startup timeout ({profile.startup_timeout_s} s)"
    elif state == RS.READY and not all_ready:
        lagging = next(s for s in rep.shards if s["state"] != SS.READY)
        return RS.DEGRADED, f"shard {lagging['rank']} on {lagging['node_id']} {lagging['state']}"
    elif state == RS.DEGRADED and all_ready:
        return RS.READY, "all shards ready again"
    return None


def _load(deployment_ids: list[int]) -> dict[int, list[_Replica]]:
    """Live replicas of the active deployments with their shards: two queries."""
    reps = {
        r.id: _Replica(r)
        for r in Replica.objects.filter(deployment_id__in=deployment_ids, state__in=replicas.LIVE_STATES).order_by(
            "created_at", "id"
        )
    }
    for s in Shard.objects.filter(replica_id__in=list(reps)).values(
        "id", "replica_id", "node_id", "rank", "state", "reason", "created_at", "http_port", "node__state"
    ):
        reps[s["replica_id"]].shards.append(s)
    by_dep: dict[int, list[_Replica]] = defaultdict(list)
    for rep in reps.values():
        rep.shards.sort(key=lambda s: s["rank"])
        by_dep[rep.row.deployment_id].append(rep)
    return by_dep


def reconcile(*, now: dt.datetime) -> Report:
    """One reconcile pass over every deployment that is not paused. Idempotent."""
    report = Report()
    report.orphans_released = release_orphans()
    deployments = {d.id: d for d in Deployment.objects.filter(paused=False).select_related("profile")}
    by_dep = _load(list(deployments))
    # What this pass decides from: replicas created after this read belong to another pass.
    loaded = {dep_id: {r.row.id for r in reps} for dep_id, reps in by_dep.items()}

    # 1. States follow shards.
    batches: dict[tuple[str, str, str], list[_Replica]] = defaultdict(list)
    routers: inflight.Totals | None = None
    for dep_id, reps in by_dep.items():
        profile = deployments[dep_id].profile
        for rep in reps:
            if rep.row.state == RS.DRAINING and rep.row.stop_requested_at is None:
                routers = routers or inflight.totals()
                stop_when_idle(rep, now=now, routers=routers)
                continue
            if rep.row.state == RS.DRAINING:
                why = _drained(rep, now)
                if why:
                    with transaction.atomic():
                        if replicas.change_state(rep.row, RS.STOPPED, now=now, reason=rep.row.reason or why):
                            allocation.release_replica(rep.row.id)
                            report.stopped += 1
                continue
            verdict = _health(rep, profile, now)
            if verdict is None:
                continue
            new, reason = verdict
            if new == RS.FAILED:
                if retire(rep, RS.FAILED, reason=reason, now=now):
                    report.failed += 1
            else:
                batches[(rep.row.state, new, reason)].append(rep)
    for (old, new, reason), batch in batches.items():
        fields = {"ready_at": now} if new == RS.READY else {}
        moved = set(replicas.move([r.row.id for r in batch], old, new, now=now, reason=reason, fields=fields))
        if new == RS.READY:
            report.ready += len(moved)
        for rep in batch:
            if rep.row.id in moved:
                rep.row.state = new
    # Draining replicas are on their way out: they count for nothing below.
    for dep_id in by_dep:
        by_dep[dep_id] = [r for r in by_dep[dep_id] if r.row.state in replicas.LIVE_STATES - {RS.DRAINING}]

    new_rows: list[Replica] = []
    for dep_id, dep in deployments.items():
        reps = by_dep.get(dep_id, [])
        fp = dep.profile.fingerprint()
        live = {r.row.id: r for r in reps}
        replacement_of = {r.row.replaces_id: r for r in reps if r.row.replaces_id in live}

        # 2. A replacement that is ready retires what it replaces.
        for old_id, new in list(replacement_of.items()):
            if new.row.state == RS.READY:
                old = live.pop(old_id)
                reason = f"replaced by {new.row.id}"
                if retire(old, RS.STOPPED, reason=reason, now=now):
                    report.stopped += 1
                del replacement_of[old_id]
                reps.remove(old)

        # 3. Drains and profile rolls: the new replica first.
        rolling = bool(replacement_of)
        for rep in list(reps):
            if rep.row.id in replacement_of or rep.row.replaces_id in live:
                continue
            on_draining = any(s["node__state"] == NodeState.DRAINING for s in rep.shards)
            stale = bool(rep.row.profile_fp) and rep.row.profile_fp != fp
            if not (on_draining or stale):
                continue
            if rep.row.state not in SERVING:
                # Not serving yet: nothing to keep up, so replace it outright.
                why = "node draining" if on_draining else "profile changed"
                if rep.row.state != RS.PENDING and retire(rep, RS.STOPPED, reason=why, now=now):
                    report.stopped += 1
                    reps.remove(rep)
                continue
            if stale and not on_draining:
                if rolling:
                    continue
                rolling = True
            why = (
                "moving off draining node " + next(s["node_id"] for s in rep.shards if s["node__state"] == "draining")
                if on_draining
                else f"profile changed ({rep.row.profile_fp} -> {fp})"
            )
            new_rows.append(
                Replica(deployment_id=dep_id, replaces_id=rep.row.id, created_at=now, updated_at=now, reason=why)
            )
            replacement_of[rep.row.id] = rep

        # 4. Scale: replacements count, what they replace does not.
        counted = [r for r in reps if r.row.id not in replacement_of]
        active = len(counted) + sum(1 for r in new_rows if r.deployment_id == dep_id and r.replaces_id)
        if active < dep.replicas:
            for _ in range(dep.replicas - active):
                new_rows.append(
                    Replica(deployment_id=dep_id, created_at=now, updated_at=now, reason="waiting for placement")
                )
        elif active > dep.replicas:
            order = {RS.PENDING: 0, RS.PLACING: 0, RS.STARTING: 1, RS.DEGRADED: 2, RS.READY: 3}
            surplus = sorted(counted, key=lambda r: (order.get(r.row.state, 0), -r.row.created_at.timestamp()))
            for rep in surplus[: active - dep.replicas]:
                if rep.row.state in (RS.PENDING, RS.PLACING) and not rep.shards:
                    if replicas.change_state(rep.row, RS.STOPPED, now=now, reason="scaled down"):
                        report.stopped += 1
                elif retire(rep, RS.STOPPED, reason="scaled down", now=now):
                    report.stopped += 1
                # What it replaced is no longer moving: it counts again next pass.
    # Deployments whose replicas keep failing to start wait longer each time, and avoid the nodes they failed on.
    waiting = {r.deployment_id for r in new_rows} | {
        dep_id for dep_id, reps in by_dep.items() if any(r.row.state == RS.PENDING for r in reps)
    }
    history = start_failures(waiting, now=now) if waiting else {}
    for r in new_rows:
        h = history.get(r.deployment_id)
        if h is not None and not r.replaces_id:
            r.not_before = h.retry_at
            r.reason = h.why(now)
    if new_rows:
        new_rows = create_replicas(new_rows, loaded, now=now)
        report.created = len(new_rows)
        for r in new_rows:
            by_dep[r.deployment_id].append(_Replica(r))

    # 5. Place what is pending, oldest first.
    pending = sorted(
        (rep.row for reps in by_dep.values() for rep in reps if rep.row.state == RS.PENDING),
        key=lambda r: (r.created_at, str(r.id)),
    )
    if pending:
        snap = kept.current(now=now)
        # A deployment's refusal holds for its next replicas until the snapshot changes.
        refused: dict[int, planner.NoPlace] = {}
        for row in pending:
            dep = deployments[row.deployment_id]
            if row.not_before is not None and row.not_before > now:
                report.pending += 1
                report.backing_off += 1
                continue
            h = history.get(dep.id)
            avoid = h.avoid if h is not None else {}
            try:
                outcome = _place(row, dep, snap, refused, now=now, avoid=avoid)
                if outcome == "conflict":
                    report.conflicts += 1
                    # Another writer took some of these cards: look again, try once more.
                    snap = kept.current(now=now, rebuild=True)
                    refused.clear()
                    outcome = _place(row, dep, snap, refused, now=now, avoid=avoid)
            except Exception as exc:
                # One deployment's bad data (a profile the wire cannot carry, say) must
                # never hold back the others: recorded on its replica, retried later.
                placement_failed(row, exc, now=now)
                report.pending += 1
                report.errors += 1
                continue
            if outcome == "placed":
                refused.clear()
                report.placed += 1
            elif outcome == "conflict":
                report.conflicts += 1
                report.pending += 1
            else:
                report.pending += 1

    # 6. Draining nodes with nothing left.
    report.drained = finish_drains(now=now)
    return report


def create_replicas(rows: list[Replica], loaded: dict[int, set[uuid.UUID]], *, now: dt.datetime) -> list[Replica]:
    """Insert a pass's new replicas, per deployment under a lock on its row; returns those created.

    The count was decided from the replicas read at the start of the pass. A
    deployment whose live replicas changed since (another pass created some)
    gets none from this pass: the next one decides again from the truth, so
    racing passes never create more than the desired count.
    """
    by_dep: dict[int, list[Replica]] = defaultdict(list)
    for r in rows:
        by_dep[r.deployment_id].append(r)
    created: list[Replica] = []
    for dep_id, dep_rows in sorted(by_dep.items()):
        with transaction.atomic():
            if not Deployment.objects.select_for_update().filter(id=dep_id).exists():
                continue
            now_live = set(
                Replica.objects.filter(deployment_id=dep_id, state__in=replicas.LIVE_STATES).values_list(
                    "id", flat=True
                )
            )
            if not now_live <= loaded.get(dep_id, set()):
                log.info("deployment %s changed under this pass; its new replicas are left to the next", dep_id)
                continue
            Replica.objects.bulk_create(dep_rows)
            PlacementEvent.objects.bulk_create(
                [
                    replicas.event(
                        "created",
                        now=now,
                        deployment_id=r.deployment_id,
                        replica_id=r.id,
                        to_state=RS.PENDING,
                        reason=r.reason,
                    )
                    for r in dep_rows
                ]
            )
        created.extend(dep_rows)
    return created


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
    """Each deployment's recent failed starts and the nodes they failed on: three queries.

    A replica that fails before it was ever ready (a port clash, a bad
    argument, weights missing) will most likely fail again the same way, so
    the next one waits (growing with each failure) and keeps off nodes where
    it failed LLMGW_AVOID_AFTER times. A ready replica resets the count.
    """
    since = now - dt.timedelta(seconds=settings.LLMGW_START_FAILURE_WINDOW)
    last_ready = dict(
        Replica.objects.filter(deployment_id__in=deployment_ids, ready_at__isnull=False)
        .values("deployment_id")
        .annotate(at=Max("ready_at"))
        .values_list("deployment_id", "at")
    )
    failed = [
        row
        for row in Replica.objects.filter(
            deployment_id__in=deployment_ids, state=RS.FAILED, ready_at__isnull=True, updated_at__gte=since
        )
        .order_by("updated_at", "id")
        .values_list("id", "deployment_id", "updated_at", "reason")
        if last_ready.get(row[1]) is None or row[2] > last_ready[row[1]]
    ]
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


def release_orphans() -> int:
    """Free the claims of replicas that no longer exist.

    Allocations name their replica by id, not by a foreign key (inventory does
    not depend on placement), so a replica deleted with its deployment, or
    lost in a database restore, would otherwise hold its GPUs for ever. Its
    processes, if any still run, are fenced by the agent sync when reported.
    A committed allocation always has its replica committed beside it, so
    this cannot free a placement in flight.
    """
    _, per_model = Allocation.objects.exclude(replica_id__in=Replica.objects.values("id")).delete()
    if per_model.get(Allocation._meta.label):
        changes.mark_all()  # rare (a deleted replica): its nodes are unknown here, so every node
    return per_model.get(Allocation._meta.label, 0)


def _place(
    row: Replica,
    dep: Deployment,
    snap: snapshots.Snapshot,
    refused: dict[int, planner.NoPlace],
    *,
    now: dt.datetime,
    avoid: dict[str, str] | None = None,
) -> str:
    """Plan one pending replica and write it whole; "placed", "pending" or "conflict".

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
        return "pending"
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


def write_placement(
    row: Replica, dep: Deployment, result: planner.Plan, snap: snapshots.Snapshot, *, now: dt.datetime
) -> None:
    """Allocations, shard rows, StartShard commands and the replica's move, in the caller's transaction."""
    profile = dep.profile
    fp = profile.fingerprint()
    leader = result.shards[0]
    leader_addr = snap.nodes[leader.node_id].mgmt_addr
    env = {**(profile.env or {}), **result.env}
    wire_profile = wire.EngineProfile(
        name=profile.name,
        engine=profile.engine,
        gpu_class=profile.gpu_class,
        tp=profile.tp,
        pp=profile.pp,
        gpus_per_node=profile.gpus_per_node,
        nodes=profile.nodes,
        args=list(profile.args or []),
        env=env,
        model_path=profile.model_path,
        served_model_name=profile.served_model_name or dep.served_model,
    )
    shards = []
    for s in result.shards:
        shard_id = uuid.uuid4()
        allocation.allocate(
            node_id=s.node_id,
            replica_id=row.id,
            shard_id=shard_id,
            gpu_indices=s.gpu_indices,
            memory_gb=s.memory_gb,
            cpu_cores=s.cpu_cores,
            power_w=s.power_w,
        )
        shards.append(
            Shard(
                id=shard_id,
                replica=row,
                node_id=s.node_id,
                rank=s.rank,
                gpu_indices=list(s.gpu_indices),
                hcas=list(s.hcas),
                http_port=s.http_port,
                state=SS.PENDING,
                profile_fp=fp,
                created_at=now,
                updated_at=now,
            )
        )
    Shard.objects.bulk_create(shards)
    for s, shard in zip(result.shards, shards, strict=True):
        if s.install_engine:
            commands.enqueue(
                s.node_id, wire.InstallEngine(engine=profile.engine, version=profile.engine_version), now=now
            )
        commands.enqueue(
            s.node_id,
            wire.StartShard(
                replica_id=str(row.id),
                shard_id=str(shard.id),
                rank=s.rank,
                nnodes=len(result.shards),
                leader_addr=leader_addr,
                leader_port=leader.leader_port or None,
                gpu_indices=list(s.gpu_indices),
                hcas=list(s.hcas),
                http_port=s.http_port,
                profile=wire_profile,
                startup_timeout_s=float(profile.startup_timeout_s),
                pool=dep.pool,
                fabric=result.fabric_name,
                nvlink_domain=result.nvlink_domain,
                profile_fp=fp,
            ),
            now=now,
        )
    where = result.nvlink_domain and f" in NVLink domain {result.nvlink_domain}"
    where = where or (result.fabric and f" on fabric {result.fabric_name} ({result.fabric})") or ""
    reason = f"placed on {', '.join(result.node_ids)}{where}"
    moved = replicas.change_state(
        row,
        RS.STARTING,
        now=now,
        reason=reason,
        pending_reasons={},
        nvlink_domain=result.nvlink_domain,
        fabric=result.fabric,
        fabric_name=result.fabric_name,
        endpoint=f"http://{leader_addr}:{leader.http_port}",
        profile_fp=fp,
    )
    if not moved:
        # Someone else moved it meanwhile (another pass placed it): undo ours.
        raise IntegrityError(f"replica {row.id} is no longer pending")


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
    rep = _Replica(row)
    rep.shards = sorted(
        Shard.objects.filter(replica_id=row.id).values(
            "id", "replica_id", "node_id", "rank", "state", "reason", "created_at", "http_port", "node__state"
        ),
        key=lambda s: s["rank"],
    )
    who = getattr(actor, "username", "") or "an operator"
    why = f"retired by {who}" + (f": {reason}" if reason else "")
    return retire(rep, RS.STOPPED, reason=why, now=now, actor=actor)
