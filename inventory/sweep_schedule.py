"""The next liveness sweep, scheduled for the moment a node's silence crosses a threshold.

Beat's fixed tick found a lost node up to one interval after its verdict was
due, and its replicas waited that long to be placed elsewhere. After each
sweep the next one is also scheduled for the earliest moment some node
(silent since its last heartbeat) crosses LLMGW_UNREACHABLE_AFTER or
LLMGW_LOST_AFTER, so the verdict lands when it is due; the lost node's
shards are failed in that sweep and a reconcile pass is queued at once.
Beat's tick stays as the safety net: a lost scheduled sweep, a node judged
late by a blind window or the lost budget, are still swept on the tick.

One scheduled sweep waits at a time: a new one is queued only when none is
waiting or when it is due earlier than the one waiting (the later one then
runs for nothing, which a sweep allows: it is idempotent).

The slot lives in the cache and the sweep is queued on the broker; neither
is needed to judge: when either cannot answer, the schedule is skipped (the
tick still sweeps), logged, and counted in
llmgw_telemetry_cache_errors_total{op="sweep_schedule"}, and the sweep task
does not fail for it.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Iterable

from celery import current_app as app
from django.conf import settings
from django.core.cache import cache
from django.db.models import Min, Q

from inventory import telemetry
from inventory.models import OPERATOR_STATES, Node, NodeState

log = logging.getLogger(__name__)

SWEEP_TASK = "agents.liveness_sweep"
PENDING_KEY = "inventory:liveness-sweep:due"
# The sweep judges last_seen < now - threshold, strictly: a sweep at the exact
# deadline would find the node not yet past it.
SLACK_S = 0.5


def next_due(
    now: dt.datetime,
    *,
    ready_last_seen: Iterable[dt.datetime | None],
    unreachable_last_seen: Iterable[dt.datetime | None],
    unreachable_after: float,
    lost_after: float,
    slack_s: float = SLACK_S,
) -> dt.datetime | None:
    """The first moment after `now` when a node still heard from in time crosses its threshold.

    `ready_last_seen` are the last heartbeats of nodes that may become
    unreachable, `unreachable_last_seen` of those that may be found lost.
    A deadline already past is left out: that node was not judged by the
    sweep that just ran (a blind window, the lost budget), and scheduling
    for it would sweep again at once, in a loop; beat's tick judges it.
    None when no node has a deadline ahead.
    """
    dues = [
        seen + dt.timedelta(seconds=after + slack_s)
        for seens, after in ((ready_last_seen, unreachable_after), (unreachable_last_seen, lost_after))
        for seen in seens
        if seen is not None
    ]
    ahead = [d for d in dues if d > now]
    return min(ahead) if ahead else None


def should_schedule(
    due: dt.datetime | None, pending: dt.datetime | None, *, now: dt.datetime, horizon_s: float
) -> bool:
    """Whether to queue a sweep for `due`, with one already queued for `pending` (None: none).

    Not beyond `horizon_s` (beat's tick): the tick comes first, and the
    sweep it runs schedules again, closer.
    """
    if due is None or (due - now).total_seconds() > horizon_s:
        return False
    return pending is None or due < pending


def oldest_deadlines(now: dt.datetime) -> tuple[dt.datetime | None, dt.datetime | None]:
    """(ready, unreachable): the oldest last heartbeat whose deadline is still ahead, per threshold; one query.

    Cordoned and draining nodes count under both thresholds: they are
    flagged after the first and their shards failed after the second.
    """
    ua, la = settings.LLMGW_UNREACHABLE_AFTER, settings.LLMGW_LOST_AFTER
    ready_after = now - dt.timedelta(seconds=ua + SLACK_S)
    lost_after = now - dt.timedelta(seconds=la + SLACK_S)
    row = Node.objects.aggregate(
        ready=Min(
            "last_seen",
            filter=Q(last_seen__gt=ready_after)
            & (Q(state=NodeState.READY) | Q(state__in=OPERATOR_STATES, unreachable_since__isnull=True)),
        ),
        unreachable=Min(
            "last_seen",
            filter=Q(last_seen__gt=lost_after) & Q(state__in=[NodeState.UNREACHABLE, *OPERATOR_STATES]),
        ),
    )
    return row["ready"], row["unreachable"]


def _pending() -> dt.datetime | None:
    raw = cache.get(PENDING_KEY)
    try:
        return dt.datetime.fromisoformat(raw) if raw else None
    except (TypeError, ValueError):
        return None


def schedule_next(*, now: dt.datetime) -> dt.datetime | None:
    """Queue a sweep for the next deadline (see module doc); returns its due time when one was queued.

    None, logged and counted, when the cache or the broker cannot answer: beat's tick sweeps anyway.
    """
    ready, unreachable = oldest_deadlines(now)
    due = next_due(
        now,
        ready_last_seen=[ready],
        unreachable_last_seen=[unreachable],
        unreachable_after=settings.LLMGW_UNREACHABLE_AFTER,
        lost_after=settings.LLMGW_LOST_AFTER,
    )
    horizon = settings.LLMGW_LIVENESS_INTERVAL
    try:
        if not should_schedule(due, _pending(), now=now, horizon_s=horizon):
            return None
        assert due is not None
        wait = (due - now).total_seconds()
        cache.set(PENDING_KEY, due.isoformat(), timeout=math.ceil(wait + horizon))
        # Dropped if a worker only gets to it a tick late: the tick's own sweep has run by then.
        app.send_task(SWEEP_TASK, kwargs={"due": due.isoformat()}, eta=due, expires=due + dt.timedelta(seconds=horizon))
    except Exception as exc:  # the cache or the broker is down: the tick is the safety net
        telemetry.CACHE_ERRORS.labels(op="sweep_schedule").inc()
        log.warning("liveness sweep not scheduled (%s: %s): beat's tick sweeps", type(exc).__name__, exc)
        return None
    log.debug("liveness sweep scheduled in %.1f s", wait)
    return due


def sweep_started(due: str | None) -> None:
    """Called by the sweep task as it starts: a scheduled sweep frees the slot it held.

    Only the sweep the slot names frees it: a later one, replaced by an
    earlier, must not free the earlier's slot. A cache that cannot answer
    leaves the slot to expire by itself.
    """
    if due:
        telemetry.best_effort(
            "sweep_schedule", lambda: cache.get(PENDING_KEY) == due and cache.delete(PENDING_KEY), False
        )
