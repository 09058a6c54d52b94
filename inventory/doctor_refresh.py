"""The doctor's results for /metrics: the last ones at once, refreshed out of band (stale-while-revalidate).

A scrape that found the doctor's results older than LLMGW_DOCTOR_CACHE used
to run every check first: 9-16 s at ten thousand nodes on a busy machine,
longer than Prometheus' scrape timeout, so the scrape failed exactly when
the fleet was large. Now a scrape serves the last results whatever their
age, and a stale one queues one refresh on the Celery worker (deduplicated
across web processes with cache.add); the results' age is exported
(llmgw_doctor_age_seconds), so a refresh that does not happen is seen, not
hidden. Only when no results were ever kept (a fresh install, a flushed
cache) does a scrape run the checks itself, once.

`GET /api/v1/doctor?fresh=1` and `manage.py doctor` still run the checks
now; this module only changes what a scrape waits for.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.core.cache import cache
from django.utils import timezone

from inventory import doctor, telemetry

log = logging.getLogger(__name__)

# The last results, kept long after the doctor's own window: what a scrape serves while a refresh runs.
KEPT_KEY = "doctor:kept"
KEPT_S = 24 * 3600
# Held while a refresh is queued or running. It is dropped when the refresh
# ends; the timeout only frees it after a worker died holding it.
QUEUED_KEY = "doctor:refresh-queued"
QUEUED_S = 300


def refresh(*, now: dt.datetime | None = None) -> tuple[dt.datetime, list[doctor.CheckResult]]:
    """Run the checks now and keep the results for scrapes to come."""
    at, results = doctor.latest(now=now or timezone.now(), fresh=True)
    telemetry.best_effort("doctor", lambda: cache.set(KEPT_KEY, (at, results), timeout=KEPT_S), None)
    return at, results


def queue_refresh() -> bool:
    """Ask the worker for one refresh, unless one is already queued or running; whether this call asked."""
    if not telemetry.best_effort("doctor", lambda: cache.add(QUEUED_KEY, True, timeout=QUEUED_S), False):
        return False
    try:
        # No retries: a broker that is down must not hold up the scrape that asked.
        refresh_doctor.apply_async(retry=False)
    except Exception as e:
        log.warning("doctor: could not queue a refresh (%s); the next stale scrape asks again", e)
        telemetry.best_effort("doctor", lambda: cache.delete(QUEUED_KEY), None)
        return False
    return True


def for_scrape(*, now: dt.datetime) -> tuple[dt.datetime, list[doctor.CheckResult]]:
    """The doctor's results and when they were taken, without waiting for the checks when any are kept.

    Within LLMGW_DOCTOR_CACHE: the doctor's cached run. Older: the last
    kept run, and one refresh queued. None kept: the checks run now.
    """
    hit = doctor.cached(now=now)
    if hit is not None:
        return hit
    kept = telemetry.best_effort("doctor", lambda: cache.get(KEPT_KEY), None)
    if kept is None:
        return refresh(now=now)
    queue_refresh()
    return kept


def age_seconds(at: dt.datetime, *, now: dt.datetime) -> float:
    """How old results taken at `at` are at `now` (never negative: clocks of two processes differ a little)."""
    return max((now - at).total_seconds(), 0.0)


def forget() -> None:
    """Drop the kept results and any queued mark (tests, benchmarks): the next scrape runs the checks."""
    cache.delete_many([KEPT_KEY, QUEUED_KEY])
    doctor.forget_cached()


@shared_task(name="inventory.refresh_doctor", time_limit=600, soft_time_limit=540, ignore_result=True)
def refresh_doctor() -> str:
    """Run the doctor's checks for the scrapes (queued by a scrape that found them stale); the verdict."""
    try:
        _, results = refresh()
    finally:
        telemetry.best_effort("doctor", lambda: cache.delete(QUEUED_KEY), None)
    return str(doctor.overall(results))
