"""Placement's doctor check: replicas waiting for a place, run through the inventory's doctor."""

from __future__ import annotations

import pytest

import llmgw_wire as wire
from inventory import doctor
from inventory.doctor import Result
from placement import agent_sync, doctor_checks
from placement.models import Deployment, EngineProfile, Replica, Shard
from placement.reconciler import reconcile
from tests.factories import make_node
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


def test_a_replica_backing_off_after_a_failed_start_names_the_engines_error(now, settings):
    settings.LLMGW_START_BACKOFF_BASE = 30
    make_node("a", now=now)
    profile = EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4)
    Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=1)
    reconcile(now=now)
    shard = Shard.objects.get()
    # An agent reports its engine dead, with the end of its log (the cause is in it, not in the exit code).
    failed = wire.ShardStatus(
        shard_id=str(shard.id),
        state="failed",
        reason="the engine exited with code 1",
        exit_code=1,
        log_tail=["INFO binding 0.0.0.0:8000", "OSError: [Errno 98] Address already in use"],
    )
    agent_sync.record_shard_states("a", [failed], now=now)
    reconcile(now=now)
    waiting = Replica.objects.get(state="pending")
    r = run(doctor_checks.check_replicas_pending, now)
    cause = "the engine exited with code 1: OSError: [Errno 98] Address already in use"
    assert_result(
        r,
        Result.WARN,
        [],
        [
            f"chat/{str(waiting.id)[:8]}: waiting 30 s before placing again: 1 failed start "
            f"(last: shard 0 on a failed: {cause})"
        ],
    )
    assert r.summary == "1 replica(s) pending, 1 backing off after failed starts"
    assert "output_tail" in r.action


def test_replicas_pending_is_registered_last():
    assert doctor.check_names()[-1] == "replicas_pending"
