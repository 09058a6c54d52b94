"""Periodic work of the agent protocol: the liveness sweep."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from inventory import liveness


@shared_task(name="agents.liveness_sweep", time_limit=120, soft_time_limit=100, ignore_result=True)
def liveness_sweep() -> dict[str, int]:
    """Move silent nodes along ready -> unreachable -> lost (idempotent: a second run finds nothing new)."""
    result = liveness.sweep(now=timezone.now())
    return {
        "unreachable": len(result.unreachable),
        "lost": len(result.lost),
        "flagged": len(result.flagged),
        "failed_shards": len(result.failed_shards),
    }
