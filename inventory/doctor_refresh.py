"""The doctor's results for /metrics: the last ones at once, refreshed out of band (stale-while-revalidate).

A scrape that found the doctor's results older than LLMGW_DOCTOR_CACHE used
to run every check first: 9-16 s at ten thousand nodes on a busy machine,
longer than Prometheus' scrape timeout, so the scrape failed exactly when
the fleet was large. Now a scrape never runs the checks: it serves the last
results whatever their age, and a stale one queues one refresh on the
Celery worker (deduplicated across web processes with cache.add); the
results' age is exported (llmgw_doctor_age_seconds), so a refresh that does
not happen is seen, not hidden. The last results are kept in the cache with
no expiry, so the very first scrape after a restart serves them, with their
age. When none were ever kept (a fresh install, a flushed cache) the scrape
writes no check result and an age of -1 (`MISSING_AGE`: no real age is
negative, and an alert on `llmgw_doctor_age_seconds > 600` does not fire on
it), and queues one refresh.

The worker's refresh is incremental (inventory/doctor/kept.py): it
re-checks only the nodes whose facts changed since its last one.
`GET /api/v1/doctor?fresh=1` and `manage.py doctor` still run every check
now; this module only changes what a scrape waits for.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.core.cache import cache
from django.utils import timezone

from inventory import doctor, telemetry
from inventory.doctor import kept as kept_doctor

log = logging.getLogger(__name__)

# The last results, kept until replaced: what a scrape serves while a refresh runs, even days later (with their age).
KEPT_KEY = "doctor:kept"
KEPT_S = None
# Held while a refresh is queued or running. It is dropped when the refresh
# ends; the timeout only frees it after a worker died holding it.
QUEUED_KEY = "doctor:refresh-queued"
# The age a scrape writes while no results were ever kept.
MISSING_AGE = -1.0
QUEUED_S = 300


def refresh(*, now: dt.datetime | None = None, full: bool = False) -> tuple[dt.datetime, list[doctor.CheckResult]]:
    """Bring the checks up to date (the changed nodes, or all when `full` or it must) and keep the results."""
    at = now or timezone.now()
    results = kept_doctor.refresh(now=at, full=full)
    doctor.store(at, results)
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


def for_scrape(*, now: dt.datetime) -> tuple[dt.datetime, list[doctor.CheckResult]] | None:
    """The doctor's results and when they were taken, never waiting for the checks.

    Within LLMGW_DOCTOR_CACHE: the doctor's cached run. Older: the last
    kept run, and one refresh queued. None kept: None, and one refresh queued.
    """
    hit = doctor.cached(now=now)
    if hit is not None:
        return hit
    kept = telemetry.best_effort("doctor", lambda: cache.get(KEPT_KEY), None)
    queue_refresh()
    return kept


def age_seconds(at: dt.datetime, *, now: dt.datetime) -> float:
    """How old results taken at `at` are at `now` (never negative: clocks of two processes differ a little)."""
    return max((now - at).total_seconds(), 0.0)


def forget() -> None:
    """Drop the kept results, any queued mark and this process's kept doctor (tests, benchmarks).

    The next scrape says the results are missing; the next refresh is a full run.
    """
    cache.delete_many([KEPT_KEY, QUEUED_KEY])
    doctor.forget_cached()
    kept_doctor.reset()


@shared_task(name="inventory.refresh_doctor", time_limit=600, soft_time_limit=540, ignore_result=True)
def refresh_doctor() -> str:
    """Refresh the doctor's results for the scrapes (queued by a scrape finding them stale or missing); the verdict."""
    try:
        _, results = refresh()
    finally:
        telemetry.best_effort("doctor", lambda: cache.delete(QUEUED_KEY), None)
    return str(doctor.overall(results))
