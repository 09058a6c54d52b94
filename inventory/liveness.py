"""The liveness sweep: nodes whose heartbeats stopped become unreachable, then lost.

ready -> unreachable after LLMGW_UNREACHABLE_AFTER without a heartbeat,
unreachable -> lost after LLMGW_LOST_AFTER. Lost means its replicas are dead:
their shards are marked failed so the reconciler releases those replicas whole
and rebuilds them elsewhere. Cordoned and draining nodes keep the operator's
state, but get `unreachable_since`, so the operator sees they are silent, and
their shards are failed after the same lost delay: a cordon does not keep a
dead machine's models alive.

Every move is a compare-and-set under the node's row lock that re-checks the
node is still silent, so a heartbeat arriving mid-sweep wins.

The control plane's own outages are never read as the fleet's death: silence
in a window when it could not listen (a gap between sweeps: the database or
beat was down; most of the fleet silent at once: the web tier or the network
in front of it) does not count against any node, a control plane hearing
only part of its fleet (a backlog: too little CPU) waits longer before it
judges, and one whose late heartbeats trail by some seconds adds that lag to
its delays (inventory/lag.py), and nodes are declared lost at a bounded rate
(check_own_health, lost_budget).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from inventory import hooks, lag
from inventory.models import OPERATOR_STATES, ControlPlaneEvent, LivenessClock, Node, NodeState
from inventory.nodes import change_state, record_event

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """The nodes a sweep moved or flagged."""

    unreachable: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)
    failed_shards: list[str] = field(default_factory=list)
    # Silent past the lost delay, but over this sweep's budget: judged by the next sweeps.
    deferred: list[str] = field(default_factory=list)
    # Most of the fleet was silent at once: nothing was judged.
    suspended: bool = False
    # The delays were this many times the configured ones: the control plane lagged (inventory/lag.py).
    stretch: float = 1.0
    # Seconds added to the delays: the late tail of the heartbeats still coming in (lag.intake_lag).
    lag_s: float = 0.0


def _silence(now: dt.datetime, cutoff: dt.datetime) -> str:
    # What the node's history says: the delay the node overstayed.
    return f"no heartbeat for {int((now - cutoff).total_seconds())} s"


def _lock_if_silent(node_id: str, state: str, cutoff: dt.datetime) -> bool:
    return (
        Node.objects.select_for_update()
        .filter(id=node_id, state=state, last_seen__lt=cutoff)
        .values_list("id", flat=True)
        .first()
        is not None
    )


def mark_unreachable(node_id: str, *, now: dt.datetime, cutoff: dt.datetime) -> bool:
    """ready -> unreachable, if the node is still ready and still silent since before `cutoff`."""
    with transaction.atomic():
        if not _lock_if_silent(node_id, NodeState.READY, cutoff):
            return False
        if not change_state(
            node_id,
            NodeState.UNREACHABLE,
            now=now,
            expected=NodeState.READY,
            reason=_silence(now, cutoff),
            actor_name="system",
        ):
            return False
        Node.objects.filter(id=node_id, unreachable_since__isnull=True).update(unreachable_since=now)
    return True


def mark_lost(node_id: str, *, now: dt.datetime, cutoff: dt.datetime) -> list[str] | None:
    """unreachable -> lost and its shards failed; None when the node came back or moved meanwhile."""
    with transaction.atomic():
        if not _lock_if_silent(node_id, NodeState.UNREACHABLE, cutoff):
            return None
        change_state(
            node_id,
            NodeState.LOST,
            now=now,
            expected=NodeState.UNREACHABLE,
            reason=_silence(now, cutoff),
            actor_name="system",
        )
        failed = hooks.workloads().fail_node(node_id, reason="node lost", now=now)
    return failed


def flag_operator_node(node_id: str, state: str, *, now: dt.datetime, cutoff: dt.datetime) -> bool:
    """A silent cordoned or draining node keeps its state; `unreachable_since` says it is silent."""
    with transaction.atomic():
        if not Node.objects.filter(
            id=node_id, state=state, last_seen__lt=cutoff, unreachable_since__isnull=True
        ).update(unreachable_since=now):
            return False
        record_event(
            node_id,
            "unreachable",
            f"{_silence(now, cutoff)}; stays {state}",
            now=now,
            actor_name="system",
        )
    return True


def fail_silent_operator_node(node_id: str, state: str, *, now: dt.datetime, cutoff: dt.datetime) -> list[str]:
    """A cordoned or draining node silent past the lost delay: its shards are dead, its state stays."""
    with transaction.atomic():
        if not _lock_if_silent(node_id, state, cutoff):
            return []
        failed = hooks.workloads().fail_node(node_id, reason="node lost", now=now)
    return failed


def _clock() -> LivenessClock:
    clock, _ = LivenessClock.objects.select_for_update().get_or_create(id=1)
    return clock


def cutoff(seconds: float, *, now: dt.datetime, clock: LivenessClock) -> dt.datetime:
    """The last_seen before which a node has been silent for `seconds` that the control plane could hear.

    A blind window [blind_from, blind_until] does not count: a node silent
    since before it needs `seconds` of heard silence besides the window, and
    a node last seen in it is judged from its end.
    """
    base = now - dt.timedelta(seconds=seconds)
    if clock.blind_from is not None and clock.blind_until is not None and base < clock.blind_until:
        return base - (clock.blind_until - clock.blind_from)
    return base


def _event(kind: str, message: str, *, now: dt.datetime, **data: object) -> None:
    ControlPlaneEvent.objects.create(at=now, kind=kind, message=message, data=data)
    log.warning("liveness: %s", message)


def _blind(clock: LivenessClock, start: dt.datetime, end: dt.datetime, reason: str) -> None:
    clock.blind_from, clock.blind_until, clock.blind_reason = start, end, reason


# A node that missed this many heartbeats counts toward a mass silence (never more than the unreachable delay).
QUIET_INTERVALS = 2.0


def quiet_after() -> float:
    """Seconds without a heartbeat after which a node counts toward a mass silence.

    Not the unreachable delay: a fleet silenced by one fault (the web tier,
    the network in front of it) stops within one heartbeat interval, so its
    nodes cross the unreachable delay one by one over that interval, and a
    sweep at the first one's deadline (inventory/sweep_schedule.py) saw only
    the few due then: it marked them, and the next sweeps the next few,
    until more than the threshold had crossed (18 of 40 live nodes in one
    run). Two missed heartbeats are seen fleet-wide long before any node is
    due, so the judgement comes before any verdict of the same silence.
    """
    return min(settings.LLMGW_UNREACHABLE_AFTER, QUIET_INTERVALS * settings.LLMGW_HEARTBEAT_INTERVAL)


def _mass_silence(now: dt.datetime, quiet_cutoff: dt.datetime, since: dt.datetime | None) -> tuple[int, int]:
    """(silent, watched): nodes not heard since `quiet_cutoff` that went silent together, among those not lost.

    A node already found silent before this silence began (a dead machine
    the sweep is dealing with) is not part of it; one the previous sweeps
    marked unreachable a moment ago is, since a fleet's heartbeats stop
    staggered over one interval.
    """
    watched = Node.objects.exclude(state=NodeState.LOST)
    ref = (since or now) - dt.timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER + settings.LLMGW_SWEEP_GAP)
    silent = watched.filter(last_seen__lt=quiet_cutoff).filter(
        Q(unreachable_since__isnull=True) | Q(unreachable_since__gte=ref)
    )
    return silent.count(), watched.count()


def check_own_health(*, now: dt.datetime) -> tuple[LivenessClock, bool]:
    """Record this sweep on the clock; (the clock, whether nodes may be judged now).

    Two faults of the control plane are told from the fleet's: a gap since
    the previous sweep (the database or beat was down, so no heartbeat could
    be accepted or no sweep run), and most of the fleet silent at once (the
    web tier, the cache or the network in front of it). The first makes the
    gap a blind window; the second stops all judgement while it lasts and
    makes its whole span a blind window when it ends, so nodes whose
    heartbeats resume within the grace keep their shards. Each is recorded as
    a ControlPlaneEvent and shown by the doctor.
    """
    with transaction.atomic():
        clock = _clock()
        last = clock.last_sweep_at
        if last is None:
            # The first sweep ever (a new install, or an upgrade): nothing says the
            # control plane was listening before, so earlier silence is not judged.
            oldest = Node.objects.order_by("last_seen").values_list("last_seen", flat=True).first()
            _blind(clock, min(oldest or now, now), now, "first sweep")
        elif (now - last).total_seconds() > settings.LLMGW_SWEEP_GAP:
            gap = int((now - last).total_seconds())
            _blind(clock, last, now, f"no sweep for {gap} s (database or beat down)")
            _event(
                "blind",
                f"no liveness sweep for {gap} s: heartbeats could not be accepted or judged meanwhile, "
                "so that silence is not held against any node",
                now=now,
                since=last.isoformat(),
            )
        clock.last_sweep_at = now
        # The whole fleet's recent silence, judged before any verdict of this sweep.
        silent, watched = _mass_silence(now, cutoff(quiet_after(), now=now, clock=clock), clock.disruption_since)
        mass = silent >= settings.LLMGW_MASS_SILENCE_MIN_NODES and silent > settings.LLMGW_MASS_SILENCE * watched
        if mass and clock.disruption_since is None:
            clock.disruption_since = now
            clock.disruption_detail = f"{silent} of {watched} nodes silent at once"
            _event(
                "mass_silence",
                f"{silent} of {watched} nodes went silent at once: read as the control plane's own outage "
                "(web, cache, network); no node is marked unreachable or lost until heartbeats resume",
                now=now,
                silent=silent,
                watched=watched,
            )
        elif not mass and clock.disruption_since is not None:
            since = clock.disruption_since
            # The silence began before it was seen: up to a lease earlier.
            began = since - dt.timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER + settings.LLMGW_SWEEP_GAP)
            if clock.blind_from is not None and clock.blind_until is not None and clock.blind_until >= began:
                # A blind window still running into this one (a gap just before): one window, not the later half.
                began = min(began, clock.blind_from)
            _blind(clock, began, now, f"mass silence ({clock.disruption_detail})")
            clock.disruption_since, clock.disruption_detail = None, ""
            _event(
                "mass_silence_over",
                f"heartbeats resumed ({silent} of {watched} nodes silent): nodes are judged again, "
                f"not counting the {int((now - since).total_seconds())} s of mass silence",
                now=now,
                silent=silent,
                watched=watched,
            )
        elif mass:
            clock.disruption_detail = f"{silent} of {watched} nodes silent at once"
        clock.save()
    return clock, not mass


def lost_budget(watched: int) -> int:
    """How many nodes one sweep may declare lost: LLMGW_LOST_RATE of the fleet (lost ones included), at least one."""
    return max(1, math.ceil(settings.LLMGW_LOST_RATE * watched))


def sweep(*, now: dt.datetime) -> SweepResult:
    """Move silent nodes along ready -> unreachable -> lost; flag silent cordoned and draining ones.

    Only silence the control plane could have heard counts (check_own_health),
    and at most lost_budget() nodes are declared lost per sweep, the longest
    silent first, so a fault that slipped past both checks still costs the
    fleet slowly. Each node is its own transaction, so one failure does not
    hold back the rest.
    """
    result = SweepResult()
    clock, judging = check_own_health(now=now)
    if not judging:
        result.suspended = True
        return result
    # A control plane hearing only part of its fleet is late, not its nodes silent: the delays stretch.
    heard = lag.hearing(now=now)
    result.stretch = heard.stretch
    if heard.stretch > 1.0:
        log.warning(
            "liveness: heard %d of %d nodes within an interval: the control plane lags, delays x%.2f",
            heard.heard,
            heard.nodes,
            heard.stretch,
        )
    # A backlog whose late tail is short of the share above still holds some nodes past the delay:
    # silence counts only past the intake's own lag.
    result.lag_s = lag.intake_lag(now=now, nodes=heard.nodes)
    if result.lag_s > 0.0:
        log.info("liveness: the intake's late tail trails by %.1f s: delays + that", result.lag_s)
    unreachable_after = max(
        settings.LLMGW_UNREACHABLE_AFTER * heard.stretch, settings.LLMGW_UNREACHABLE_AFTER + result.lag_s
    )
    lost_after = max(settings.LLMGW_LOST_AFTER * heard.stretch, settings.LLMGW_LOST_AFTER + result.lag_s)
    unreachable_cutoff = cutoff(unreachable_after, now=now, clock=clock)
    lost_cutoff = cutoff(lost_after, now=now, clock=clock)
    for node_id in Node.objects.filter(state=NodeState.READY, last_seen__lt=unreachable_cutoff).values_list(
        "id", flat=True
    ):
        if mark_unreachable(node_id, now=now, cutoff=unreachable_cutoff):
            result.unreachable.append(node_id)
    budget = lost_budget(Node.objects.count())
    for node_id in (
        Node.objects.filter(state=NodeState.UNREACHABLE, last_seen__lt=lost_cutoff)
        .order_by("last_seen", "id")
        .values_list("id", flat=True)
    ):
        if len(result.lost) >= budget:
            result.deferred.append(node_id)
            continue
        failed = mark_lost(node_id, now=now, cutoff=lost_cutoff)
        if failed is not None:
            result.lost.append(node_id)
            result.failed_shards.extend(failed)
    for node_id, state in Node.objects.filter(
        state__in=OPERATOR_STATES, last_seen__lt=unreachable_cutoff, unreachable_since__isnull=True
    ).values_list("id", "state"):
        if flag_operator_node(node_id, state, now=now, cutoff=unreachable_cutoff):
            result.flagged.append(node_id)
    # Only those with a shard not yet over: one query, not one per silent node.
    silent_with_shards = (
        Node.objects.filter(
            state__in=OPERATOR_STATES,
            last_seen__lt=lost_cutoff,
            id__in=hooks.workloads().nodes_with_live_shards(),
        )
        .order_by("last_seen", "id")
        .values_list("id", "state")
    )
    for node_id, state in silent_with_shards:
        if len(result.lost) >= budget:
            result.deferred.append(node_id)
            continue
        failed = fail_silent_operator_node(node_id, state, now=now, cutoff=lost_cutoff)
        if failed:
            result.lost.append(node_id)
        result.failed_shards.extend(failed)
    if result.deferred:
        log.warning(
            "liveness: %d silent nodes left for later sweeps (at most %d lost per sweep)", len(result.deferred), budget
        )
    if result.unreachable or result.lost or result.flagged:
        log.info(
            "liveness: %d unreachable, %d lost, %d flagged, %d shards failed",
            len(result.unreachable),
            len(result.lost),
            len(result.flagged),
            len(result.failed_shards),
        )
    return result
