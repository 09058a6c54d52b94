"""Celery tasks of placement: the reconciler, run by beat and queued by events."""

from __future__ import annotations

import datetime as dt
import logging
import uuid

from celery import shared_task
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from placement import reconciler

log = logging.getLogger(__name__)

LOCK_KEY = "placement:reconcile:lock"
SOFT_LIMIT_S = 60
HARD_LIMIT_S = 90


class _Lock:
    """A single-flight lock in the shared cache; it expires if its holder dies."""

    def __init__(self, key: str, ttl: int) -> None:
        self.key, self.ttl, self.token = key, ttl, uuid.uuid4().hex

    def __enter__(self) -> bool:
        self.held = cache.add(self.key, self.token, timeout=self.ttl)
        return self.held

    def __exit__(self, *exc: object) -> None:
        if self.held and cache.get(self.key) == self.token:
            cache.delete(self.key)


@shared_task(name="placement.reconcile", soft_time_limit=SOFT_LIMIT_S, time_limit=HARD_LIMIT_S, ignore_result=True)
def reconcile_task(now: str | dt.datetime | None = None) -> dict | None:
    """One reconcile pass, unless one is already running (then this one is redundant).

    `now` (ISO text or datetime) is for tests; beat and events leave it out.
    """
    if isinstance(now, str):
        now = dt.datetime.fromisoformat(now)
    with _Lock(LOCK_KEY, HARD_LIMIT_S) as held:
        if not held:
            log.info("reconcile already running; skipped")
            return None
        report = reconciler.reconcile(now=now or timezone.now())
    return dict(report.__dict__)


def queue_reconcile() -> None:
    """Queue a pass once the caller's transaction commits (a deployment changed)."""
    transaction.on_commit(reconcile_task.delay)
