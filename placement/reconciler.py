"""The reconciler: make the running replicas what the deployments ask for, and keep them so.

One pass, given `now`:
1. each live replica's state follows its shards (ready when all are; a failed
   shard or a lost node fails it, and it is released whole and placed again);
2. a replica whose replacement is ready is stopped (drains and profile rolls
   start the new replica first, so ready capacity never dips);
3. replicas on draining nodes get replacements; a changed profile rolls one
   replica at a time per deployment;
4. autoscaled deployments get their count from the load (placement/scaling.py);
   deployments are scaled up (new pending replicas) and down (the replica
   that costs least to lose: fewest requests in flight, then the one on the
   emptiest nodes, so what it frees is whole nodes rather than scattered cards);
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
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import transaction

from inventory import allocation, changes
from inventory.models import Allocation, NodeState
from llmgw import db
from llmgw_wire import shard_states
from placement import backoff, batch_writes, inflight, kept, placing, planner, replicas, retiring, scaling
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, ReplicaState, Shard
from placement.retiring import SERVING, LiveReplica, retire
from placement.snapshot import Snapshot

log = logging.getLogger(__name__)

RS = ReplicaState
# Replicas one pass creates, or stops for a scale-down, per deployment. A thousand-replica scale-up is
# one pass: as four of 256, each read the deployments, their replicas and the index's changes again,
# and the four cost 1.20-1.26 s of a quiet worker at 10,000 nodes against 0.78-0.96 s for one
# (`python -m bench reconcile`). Still a bound: the largest deployment allowed (bounds.MAX_REPLICAS)
# is ten passes, each about a second.
BATCH_PER_PASS = 1024
SS = shard_states.S


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
    # A deployment's scale-up or scale-down was cut at BATCH_PER_PASS: the next pass carries it on at once.
    more: bool = False
    drained: list[str] = field(default_factory=list)
    # The autoscaler's changes: "deployment id: reason".
    autoscaled: list[str] = field(default_factory=list)


@dataclass
class Pass:
    """One reconcile pass: what it read at the start, what it decided, and what it did."""

    now: dt.datetime
    deployments: dict[int, Deployment]
    # Live replicas by deployment; the steps below remove what they retire and add what they create.
    by_dep: dict[int, list[LiveReplica]]
    # What this pass decides from: replicas created after this read belong to another pass.
    loaded: dict[int, set[uuid.UUID]]
    report: Report = field(default_factory=Report)
    # Replicas to create (scale-ups and replacements), decided by steps 3 and 4.
    new_rows: list[Replica] = field(default_factory=list)
    # Recent failed starts of the deployments with something to place.
    history: dict[int, backoff.StartFailures] = field(default_factory=dict)
    # Requests in flight per replica, read once when a scale-down has serving replicas to choose from.
    routers: inflight.Totals | None = None


@dataclass
class Fleet:
    """One deployment's live replicas while steps 2 to 4 decide over them."""

    dep: Deployment
    reps: list[LiveReplica]
    live: dict[uuid.UUID, LiveReplica]
    # The id of a replica being replaced -> its replacement.
    replacement_of: dict[uuid.UUID, LiveReplica]


def _health(rep: LiveReplica, profile: EngineProfile, now: dt.datetime) -> tuple[str, str] | None:
    """The state a live, placed replica should be in by its shards, and why; None to stay."""
    state = rep.row.state
    if not rep.shards:
        return None
    for s in rep.shards:
        where = f"shard {s['rank']} on {s['node_id']}"
        if s["node__state"] == NodeState.LOST:
            return RS.FAILED, f"node {s['node_id']} lost"
        if s["state"] == SS.FAILED and s.get("port_in_use") is not None:
            # The node's fact, not the deployment's failure: no backoff, no avoidance (placement.backoff).
            return RS.FAILED, (
                f"{where}: port {s['port_in_use']} was already in use on the node;"
                " placed again on another port (not counted as a failed start)"
            )
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


def _load(deployment_ids: list[int]) -> dict[int, list[LiveReplica]]:
    """Live replicas of the active deployments with their shards: two queries."""
    reps = {
        r.id: LiveReplica(r)
        for r in Replica.objects.filter(deployment_id__in=deployment_ids, state__in=replicas.LIVE_STATES).order_by(
            "created_at", "id"
        )
    }
    for s in Shard.objects.filter(replica_id__in=list(reps)).values(*retiring.SHARD_FIELDS):
        reps[s["replica_id"]].shards.append(s)
    by_dep: dict[int, list[LiveReplica]] = defaultdict(list)
    for rep in reps.values():
        rep.shards.sort(key=lambda s: s["rank"])
        by_dep[rep.row.deployment_id].append(rep)
    return by_dep


def reconcile(*, now: dt.datetime) -> Report:
    """One reconcile pass over every deployment that is not paused. Idempotent."""
    orphans = release_orphans()
    retiring.release_leftover_shards(now=now)
    deployments = {d.id: d for d in Deployment.objects.filter(paused=False).select_related("profile")}
    by_dep = _load(list(deployments))
    p = Pass(
        now=now,
        deployments=deployments,
        by_dep=by_dep,
        loaded={d: {r.row.id for r in reps} for d, reps in by_dep.items()},
    )
    p.report.orphans_released = orphans
    follow_shards(p)
    p.report.autoscaled = [f"{s.deployment_id}: {s.reason}" for s in scaling.apply(deployments, p.by_dep, now=now)]
    for dep in deployments.values():
        fleet = retire_replaced(p, dep)
        replace_moving(p, fleet)
        scale(p, fleet)
    create_new(p)
    place_pending(p)
    p.report.drained = retiring.finish_drains(now=now)
    return p.report


def follow_shards(p: Pass) -> None:
    """Step 1: each live replica's state follows its shards; draining ones stop when done.

    Replicas that change alike move in one batch. Draining replicas are on
    their way out: the steps after this one count them for nothing.
    """
    now, report = p.now, p.report
    batches: dict[tuple[str, str, str], list[LiveReplica]] = defaultdict(list)
    routers: inflight.Totals | None = None
    for dep_id, reps in p.by_dep.items():
        profile = p.deployments[dep_id].profile
        for rep in reps:
            if rep.row.state == RS.DRAINING and rep.row.stop_requested_at is None:
                routers = routers or inflight.totals()
                retiring.stop_when_idle(rep, now=now, routers=routers)
                continue
            if rep.row.state == RS.DRAINING:
                why = retiring.drain_done(rep, now)
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
    for dep_id in p.by_dep:
        p.by_dep[dep_id] = [r for r in p.by_dep[dep_id] if r.row.state in replicas.LIVE_STATES - {RS.DRAINING}]


def retire_replaced(p: Pass, dep: Deployment) -> Fleet:
    """Step 2: a replacement that is ready retires what it replaces; returns the deployment's fleet."""
    reps = p.by_dep.get(dep.id, [])
    live = {r.row.id: r for r in reps}
    replacement_of = {r.row.replaces_id: r for r in reps if r.row.replaces_id in live}
    for old_id, new in list(replacement_of.items()):
        if new.row.state == RS.READY:
            old = live.pop(old_id)
            reason = f"replaced by {new.row.id}"
            if retire(old, RS.STOPPED, reason=reason, now=p.now):
                p.report.stopped += 1
            del replacement_of[old_id]
            reps.remove(old)
    return Fleet(dep=dep, reps=reps, live=live, replacement_of=replacement_of)


def replace_moving(p: Pass, fleet: Fleet) -> None:
    """Step 3: replicas on draining nodes get replacements; a changed profile rolls one at a time.

    The new replica starts first and the old one is retired only once it is
    ready (step 2), so ready capacity never dips.
    """
    now, dep_id, reps = p.now, fleet.dep.id, fleet.reps
    fp = fleet.dep.profile.fingerprint()
    rolling = bool(fleet.replacement_of)
    for rep in list(reps):
        if rep.row.id in fleet.replacement_of or rep.row.replaces_id in fleet.live:
            continue
        on_draining = any(s["node__state"] == NodeState.DRAINING for s in rep.shards)
        stale = bool(rep.row.profile_fp) and rep.row.profile_fp != fp
        if not (on_draining or stale):
            continue
        if rep.row.state not in SERVING:
            # Not serving yet: nothing to keep up, so replace it outright.
            why = "node draining" if on_draining else "profile changed"
            if rep.row.state != RS.PENDING and retire(rep, RS.STOPPED, reason=why, now=now):
                p.report.stopped += 1
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
        p.new_rows.append(
            Replica(deployment_id=dep_id, replaces_id=rep.row.id, created_at=now, updated_at=now, reason=why)
        )
        fleet.replacement_of[rep.row.id] = rep


def scale(p: Pass, fleet: Fleet) -> None:
    """Step 4: new pending replicas up to the desired count, or the surplus stopped.

    Replacements count, what they replace does not. The surplus stopped is
    what costs least to lose: what does not serve yet first; among serving
    replicas the one with the fewest requests in flight, then the one on the
    emptiest nodes (its cards join free ones, leaving whole nodes for the
    next replica that needs many), then the newest.
    At most BATCH_PER_PASS either way: the rest is the next passes'.
    """
    now, dep = p.now, fleet.dep
    counted = [r for r in fleet.reps if r.row.id not in fleet.replacement_of]
    active = len(counted) + sum(1 for r in p.new_rows if r.deployment_id == dep.id and r.replaces_id)
    if active < dep.replicas:
        # In batches: a count of thousands costs one batch of rows a pass, not the worker's memory or the pass.
        p.report.more |= dep.replicas - active > BATCH_PER_PASS
        for _ in range(min(dep.replicas - active, BATCH_PER_PASS)):
            p.new_rows.append(
                Replica(deployment_id=dep.id, created_at=now, updated_at=now, reason="waiting for placement")
            )
    elif active > dep.replicas:
        order = {RS.PENDING: 0, RS.PLACING: 0, RS.STARTING: 1, RS.DEGRADED: 2, RS.READY: 3}
        busy: dict[str, int] = {}
        free: dict[str, int] = {}
        if any(r.row.state in SERVING for r in counted):
            p.routers = p.routers or inflight.totals()
            busy = p.routers.per_replica
            nodes = kept.current(now=now).nodes
            free = {n: nodes[n].free_count() for r in counted for s in r.shards if (n := s["node_id"]) in nodes}

        def cost(r: LiveReplica) -> tuple:
            return (
                order.get(r.row.state, 0),
                busy.get(str(r.row.id), 0),
                -sum(free.get(s["node_id"], 0) for s in r.shards),
                -r.row.created_at.timestamp(),
            )

        surplus = sorted(counted, key=cost)
        p.report.more |= active - dep.replicas > BATCH_PER_PASS
        for rep in surplus[: min(active - dep.replicas, BATCH_PER_PASS)]:
            if rep.row.state in (RS.PENDING, RS.PLACING) and not rep.shards:
                if replicas.change_state(rep.row, RS.STOPPED, now=now, reason="scaled down"):
                    p.report.stopped += 1
            elif retire(rep, RS.STOPPED, reason="scaled down", now=now):
                p.report.stopped += 1
            # What it replaced is no longer moving: it counts again next pass.


def create_new(p: Pass) -> None:
    """Create the replicas steps 3 and 4 decided on, new ones waiting out their deployment's start backoff.

    Deployments whose replicas keep failing to start wait longer each time,
    and avoid the nodes they failed on (kept in `p.history` for step 5).
    """
    now = p.now
    waiting = {r.deployment_id for r in p.new_rows} | {
        dep_id for dep_id, reps in p.by_dep.items() if any(r.row.state == RS.PENDING for r in reps)
    }
    p.history = backoff.start_failures(waiting, now=now) if waiting else {}
    for r in p.new_rows:
        h = p.history.get(r.deployment_id)
        if h is not None and not r.replaces_id:
            r.not_before = h.retry_at
            r.reason = h.why(now)
    if p.new_rows:
        p.new_rows = create_replicas(p.new_rows, p.loaded, now=now)
        p.report.created = len(p.new_rows)
        for r in p.new_rows:
            p.by_dep[r.deployment_id].append(LiveReplica(r))


def place_pending(p: Pass) -> None:
    """Step 5: place what is pending, each deployment's oldest first and the deployments in turn, over one
    snapshot of the cluster.

    A conflict (another writer took some of the cards) is retried once over a
    fresh snapshot; a placement that raises is recorded on its replica and
    never holds back the others.
    """
    now = p.now
    pending = in_turn(rep.row for reps in p.by_dep.values() for rep in reps if rep.row.state == RS.PENDING)
    # Kept current on every pass, pending work or not: asked first by a scale-up, the index was
    # built then (5-10 s at 10,000 nodes, in each worker process), and the first thousand replicas
    # waited for it; kept warm, a pass with nothing changed costs one cache round trip.
    if not pending:
        kept.current(now=now)
        return
    # Held until the last batch is written: the keeper thread's update would drop the claims of a
    # batch not yet written (kept.KeptIndex.planning).
    with kept.planning(now=now) as snap:
        _place_all(p, pending, snap)


def _place_all(p: Pass, pending: list[Replica], snap: Snapshot) -> None:
    now, report = p.now, p.report
    # A deployment's refusal holds for its next replicas until the snapshot changes.
    refused: dict[int, planner.NoPlace] = {}
    # A scale-up's placements are written in batches (placement/batch_writes.py).
    batch = batch_writes.BatchWriter(snap, now=now) if len(pending) >= batch_writes.MIN_BATCH else None
    for row in pending:
        dep = p.deployments[row.deployment_id]
        if row.not_before is not None and row.not_before > now:
            report.pending += 1
            report.backing_off += 1
            continue
        h = p.history.get(dep.id)
        avoid = h.avoid if h is not None else {}
        try:
            outcome = placing.place(row, dep, snap, refused, now=now, avoid=avoid, batch=batch)
            if outcome == "conflict":
                report.conflicts += 1
                # Another writer took some of these cards: look again, try once more.
                snap = kept.current(now=now, rebuild=True)
                refused.clear()
                outcome = placing.place(row, dep, snap, refused, now=now, avoid=avoid)
        except Exception as exc:
            # One deployment's bad data (a profile the wire cannot carry, say) must
            # never hold back the others: recorded on its replica, retried later.
            backoff.placement_failed(row, exc, now=now)
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
    if batch is not None:
        for row, exc in batch.close(report):
            backoff.placement_failed(row, exc, now=now)


def in_turn(rows: Iterable[Replica]) -> list[Replica]:
    """Pending replicas in the order they are placed: each deployment's first, then each one's second, ...

    Within a deployment, the oldest first; between deployments, in turn, so
    one asking for thousands cannot keep the others' first replica waiting
    behind its own in the same pass.
    """
    turn: dict[int, int] = defaultdict(int)
    keyed = []
    for r in sorted(rows, key=lambda r: (r.created_at, str(r.id))):
        keyed.append((turn[r.deployment_id], r.created_at, str(r.id), r))
        turn[r.deployment_id] += 1
    return [k[3] for k in sorted(keyed, key=lambda k: k[:3])]


def create_replicas(rows: list[Replica], loaded: dict[int, set[uuid.UUID]], *, now: dt.datetime) -> list[Replica]:
    """Insert a pass's new replicas under a lock on their deployments' rows; returns those created.

    The count was decided from the replicas read at the start of the pass. A
    deployment whose live replicas changed since (another pass created some)
    gets none from this pass: the next one decides again from the truth, so
    racing passes never create more than the desired count.
    """
    by_dep: dict[int, list[Replica]] = defaultdict(list)
    for r in rows:
        by_dep[r.deployment_id].append(r)
    with transaction.atomic():
        # Every deployment locked in one statement, in id order (racing passes queue, never deadlock),
        # then read again in one: four statements however many deployments scale up.
        locked = list(
            Deployment.objects.select_for_update()
            .filter(id__in=list(by_dep))
            .order_by("id")
            .values_list("id", flat=True)
        )
        now_live: dict[int, set[uuid.UUID]] = defaultdict(set)
        for dep_id, rid in Replica.objects.filter(deployment_id__in=locked, state__in=replicas.LIVE_STATES).values_list(
            "deployment_id", "id"
        ):
            now_live[dep_id].add(rid)
        created: list[Replica] = []
        for dep_id in locked:
            if not now_live[dep_id] <= loaded.get(dep_id, set()):
                log.info("deployment %s changed under this pass; its new replicas are left to the next", dep_id)
                continue
            created.extend(by_dep[dep_id])
        if created:
            # The replicas and their events in one statement (llmgw.db.insert_rows): through the ORM a
            # thousand of each cost a scale-up's pass more than planning them.
            db.insert_rows(
                [
                    (Replica, db.columns_of(created)),
                    (
                        PlacementEvent,
                        [
                            replicas.event_row(
                                "created",
                                now=now,
                                deployment_id=r.deployment_id,
                                replica_id=r.id,
                                to_state=RS.PENDING,
                                reason=r.reason,
                            )
                            for r in created
                        ],
                    ),
                ]
            )
    return created


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
