"""One doctor run shared by /metrics and the API for settings.LLMGW_DOCTOR_CACHE seconds."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.core.cache import cache

from inventory import telemetry
from inventory.doctor.loader import Inventory, load_inventory
from inventory.doctor.registry import run_checks
from inventory.doctor.results import CheckResult


def run(*, now: dt.datetime) -> list[CheckResult]:
    """Load the inventory and run every check."""
    return run_checks(load_inventory(now=now))


_LATEST_KEY = "doctor:latest"


def latest(
    *, now: dt.datetime, fresh: bool = False, inv: Inventory | None = None
) -> tuple[dt.datetime, list[CheckResult]]:
    """The doctor's results and when they were taken, reused for settings.LLMGW_DOCTOR_CACHE seconds.

    Every /metrics scrape (one per Prometheus server, every 15-30 s) and
    every API call used to rerun every check over the whole cluster; they now
    share one run, so what they show may be that many seconds old (the
    returned time says how old). `fresh` runs the checks anyway and stores
    the result; `inv`, a snapshot taken at `now`, saves reading one again.
    Two callers that miss at the same moment both run the checks: harmless.
    """
    if not fresh:
        hit = cached(now=now)
        if hit is not None:
            return hit
    results = run_checks(inv if inv is not None else load_inventory(now=now))
    store(now, results)
    return now, results


def store(at: dt.datetime, results: list[CheckResult]) -> None:
    """Keep results taken at `at` for the API and the scrapes to reuse (see `latest`)."""
    telemetry.best_effort(
        "doctor", lambda: cache.set(_LATEST_KEY, (at, results), timeout=settings.LLMGW_DOCTOR_CACHE), None
    )


def cached(*, now: dt.datetime) -> tuple[dt.datetime, list[CheckResult]] | None:
    """The stored results when still fresh at `now` (see `latest`), else None."""
    hit = telemetry.best_effort("doctor", lambda: cache.get(_LATEST_KEY), None)
    if hit is not None and 0 <= (now - hit[0]).total_seconds() < settings.LLMGW_DOCTOR_CACHE:
        return hit
    return None


def forget_cached() -> None:
    """Drop the stored results, so the next caller runs the checks."""
    cache.delete(_LATEST_KEY)
