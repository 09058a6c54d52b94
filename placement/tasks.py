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
    """One reconcile pass, unless one is already running (then this one is redundant).

    `now` (ISO text or datetime) is for tests; beat and events leave it out.
    """
    if isinstance(now, str):
        now = dt.datetime.fromisoformat(now)
    # Before anything is read: a change from here on queues the next pass.
    queueing.reconcile_started()
    # A database lock, not a cache key: it ends with its holder's session, so a
    # worker killed mid-pass blocks the next pass for no time at all.
    with locks.single_flight(LOCK_NAME) as held:
        if not held:
            log.info("reconcile already running; skipped")
            return None
        report = reconciler.reconcile(now=now or timezone.now())
    if report.more:
        # Asked once the lock is let go, so the next pass runs rather than finding this one still running:
        # a thousand replicas asked for at once are four passes back to back, not four beat ticks apart.
        queueing.ask_now("the last pass left replicas of a scale-up or scale-down for the next")
    return dict(report.__dict__)
