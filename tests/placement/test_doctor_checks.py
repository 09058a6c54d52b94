"""Placement's doctor check: replicas waiting for a place, run through the inventory's doctor."""

from __future__ import annotations

import pytest

from inventory import doctor
from inventory.doctor import Result
from placement import doctor_checks
from placement.models import Deployment, EngineProfile, Replica
from tests.inventory.doctor.helpers import assert_result, run

pytestmark = pytest.mark.django_db


def test_replicas_pending(now):
    profile = EngineProfile.objects.create(name="llama-70b-tp4", engine="vllm", tp=4)
    dep = Deployment.objects.create(name="llama", served_model="llama-70b", profile=profile)
    Replica.objects.create(deployment=dep, state="ready", created_at=now, updated_at=now)
    assert_result(run(doctor_checks.check_replicas_pending, now), Result.PASS, [])
    r1 = Replica.objects.create(
        deployment=dep, state="pending", reason="no node has 4 free H100-80GB", created_at=now, updated_at=now
    )
    r = run(doctor_checks.check_replicas_pending, now)
    assert_result(r, Result.WARN, [], [f"llama/{str(r1.id)[:8]}: no node has 4 free H100-80GB"])


def test_replicas_pending_is_registered_last():
    assert doctor.check_names()[-1] == "replicas_pending"
