"""The inventory's Celery tasks, called directly."""

from __future__ import annotations

import pytest
from django.conf import settings

from inventory import tasks
from inventory.models import Command
from tests.factories import make_node
from tests.inventory.ibports import SM_OTHER, ib_port, put

pytestmark = pytest.mark.django_db


def test_fabric_scan_task_is_on_the_beat_every_interval():
    entry = settings.CELERY_BEAT_SCHEDULE["inventory.schedule_fabric_scans"]
    assert entry == {"task": "inventory.schedule_fabric_scans", "schedule": 600.0}
    assert tasks.schedule_fabric_scans.name == "inventory.schedule_fabric_scans"
    assert tasks.schedule_fabric_scans.time_limit == 60


def test_fabric_scan_task_asks_each_fabric_once(now):
    from django.utils import timezone

    make_node("a", now=now, gpus=0)
    put("a", now=timezone.now(), ports=[ib_port("mlx5_0"), ib_port("mlx5_1", sm_guid=SM_OTHER)])
    assert tasks.schedule_fabric_scans() == 2
    # Idempotent while the commands are outstanding.
    assert tasks.schedule_fabric_scans() == 0
    assert sorted(c.payload["hca"] for c in Command.objects.filter(node_id="a", kind="scan_fabric")) == [
        "mlx5_0",
        "mlx5_1",
    ]


def test_fabric_scan_task_with_no_fabric_does_nothing(now):
    make_node("a", now=now, gpus=0)
    assert tasks.schedule_fabric_scans() == 0
    assert Command.objects.count() == 0
