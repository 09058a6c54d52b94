"""Replica moves: each leaves its event row and, once committed, one INFO line saying what happened and why."""

from __future__ import annotations

import logging

import pytest
from django.db import transaction

from placement import replicas
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, ReplicaState

pytestmark = pytest.mark.django_db


@pytest.fixture
def starting(now) -> Replica:
    profile = EngineProfile.objects.create(name="echo-1", engine="echo")
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=1)
    return Replica.objects.create(deployment=dep, state=ReplicaState.STARTING, created_at=now, updated_at=now)


def lines(caplog) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]


def test_a_replica_that_becomes_ready_is_one_info_line(starting, now, caplog, django_capture_on_commit_callbacks):
    with caplog.at_level(logging.INFO), django_capture_on_commit_callbacks(execute=True):
        assert replicas.move([starting.id], ReplicaState.STARTING, ReplicaState.READY, now=now) == [starting.id]
    assert lines(caplog) == [
        (
            "placement.replicas",
            "INFO",
            f"replica {starting.id} (deployment {starting.deployment_id}): starting -> ready (by system)",
        )
    ]


def test_a_replica_that_fails_says_why(starting, now, caplog, django_capture_on_commit_callbacks):
    why = "rank 0 on node-a: OSError: [Errno 98] Address already in use"
    with caplog.at_level(logging.INFO), django_capture_on_commit_callbacks(execute=True):
        replicas.move([starting.id], ReplicaState.STARTING, ReplicaState.FAILED, now=now, reason=why)
    assert lines(caplog) == [
        (
            "placement.replicas",
            "INFO",
            f"replica {starting.id} (deployment {starting.deployment_id}): starting -> failed: {why} (by system)",
        )
    ]


def test_a_move_rolled_back_never_happened_and_logs_nothing(starting, now, caplog, django_capture_on_commit_callbacks):
    with (
        caplog.at_level(logging.INFO),
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        replicas.move([starting.id], ReplicaState.STARTING, ReplicaState.READY, now=now)
        raise RuntimeError("the caller's next write failed")
    assert callbacks == []
    assert lines(caplog) == []
    assert Replica.objects.get(id=starting.id).state == ReplicaState.STARTING
    assert not PlacementEvent.objects.filter(replica=starting).exists()
