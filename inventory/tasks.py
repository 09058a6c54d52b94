"""Periodic work of the inventory: fabric scans."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from inventory import scans
from inventory.doctor_refresh import refresh_doctor  # noqa: F401  (the worker learns the task here)


@shared_task(name="inventory.schedule_fabric_scans", time_limit=60, soft_time_limit=50, ignore_result=True)
def schedule_fabric_scans() -> int:
    """Ask one port per InfiniBand fabric to run ibnetdiscover; returns how many were asked.

    Idempotent: a fabric with a recent scan command still outstanding is not asked again.
    """
    return len(scans.schedule_fabric_scans(now=timezone.now()))
