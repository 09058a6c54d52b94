"""Periodic work of the agent protocol: the liveness sweep."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from inventory import liveness, sweep_schedule


@shared_task(name="agents.liveness_sweep", time_limit=120, soft_time_limit=100, ignore_result=True)
def liveness_sweep(due: str | None = None) -> dict[str, int]:
    """Move silent nodes along ready -> unreachable -> lost (idempotent: a second run finds nothing new).

    `due`: set on a sweep scheduled for a node's deadline (inventory/sweep_schedule.py), not on beat's.
    """
    sweep_schedule.sweep_started(due)
    result = liveness.sweep(now=timezone.now())
    sweep_schedule.schedule_next(now=timezone.now())
    return {
        "unreachable": len(result.unreachable),
        "lost": len(result.lost),
        "flagged": len(result.flagged),
        "failed_shards": len(result.failed_shards),
    }
