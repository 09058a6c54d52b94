"""Periodic work of the inventory: fabric scans and the liveness sweep."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from inventory import liveness, scans, sweep_schedule
from inventory.doctor_refresh import refresh_doctor  # noqa: F401  (the worker learns the task here)


@shared_task(name="inventory.schedule_fabric_scans", time_limit=60, soft_time_limit=50, ignore_result=True)
def schedule_fabric_scans() -> int:
    """Ask one port per InfiniBand fabric to run ibnetdiscover; returns how many were asked.

    Idempotent: a fabric with a recent scan command still outstanding is not asked again.
    """
    return len(scans.schedule_fabric_scans(now=timezone.now()))


# The name predates the task's move out of the agents app: the beat schedule
# and any task already queued under it keep working.
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
