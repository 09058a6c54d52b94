"""Celery tasks of placement: the reconciler, run by beat and queued by events."""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.utils import timezone

from llmgw import locks
from placement import queueing, reconciler

log = logging.getLogger(__name__)

LOCK_NAME = "reconcile"
SOFT_LIMIT_S = 60
HARD_LIMIT_S = 90


@shared_task(name=queueing.TASK_NAME, soft_time_limit=SOFT_LIMIT_S, time_limit=HARD_LIMIT_S, ignore_result=True)
def reconcile_task(now: str | dt.datetime | None = None) -> dict | None:
    """One reconcile pass, unless one is already running (then that one is asked for another as it ends).

    `now` (ISO text or datetime) is for tests; beat and events leave it out.
    """
    if isinstance(now, str):
        now = dt.datetime.fromisoformat(now)
    # Before anything is read: a change from here on queues the next pass.
    queueing.reconcile_started()
    report = _one_pass(now)
    if report is None:
        # The running pass may have read before the change this one was queued for: marked, it asks for
        # one more as it ends. Then tried once more, for it may have looked for the mark and gone already.
        queueing.ask_after_running()
        report = _one_pass(now)
        if report is None:
            return None
    # Asked once the lock is let go, so the next pass runs rather than finding this one still running:
    # a thousand replicas asked for at once are passes back to back, not beat ticks apart.
    owed = queueing.take_ask_after()
    if report.more or owed:
        queueing.ask_now("the last pass left work for the next" if report.more else "asked for while a pass ran")
    return dict(report.__dict__)


def _one_pass(now: dt.datetime | None) -> reconciler.Report | None:
    """A pass under the cluster-wide lock; None when another process holds it."""
    # A database lock, not a cache key: it ends with its holder's session, so a
    # worker killed mid-pass blocks the next pass for no time at all.
    with locks.single_flight(LOCK_NAME) as held:
        if not held:
            log.info("reconcile already running; skipped")
            return None
        # This pass reads everything from here on: a mark left before it is answered by it.
        queueing.take_ask_after()
        return reconciler.reconcile(now=now or timezone.now())
