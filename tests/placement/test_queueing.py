"""One reconcile pass waiting at a time, however many changes ask for one."""

from __future__ import annotations

import pytest
from django.test import override_settings

from placement import queueing
from placement.models import Deployment, EngineProfile
from placement.reconciler import BATCH_PER_PASS
from placement.tasks import reconcile_task
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """The task names queued to the broker, in order."""
    names: list[str] = []
    monkeypatch.setattr(queueing.app, "send_task", lambda name, *a, **kw: names.append(name))
    return names


def test_two_asks_queue_one_pass(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        assert queueing.queue_reconcile(reason="shard ready")
        assert queueing.queue_reconcile(reason="node lost")
    assert sent == ["placement.reconcile"]
    assert queueing.reconcile_queued()


def test_asks_in_separate_transactions_still_queue_one(sent, django_capture_on_commit_callbacks):
    for reason in ("shard ready", "node lost", "deployment changed", "", "shard failed"):
        with django_capture_on_commit_callbacks(execute=True):
            queueing.queue_reconcile(reason=reason)
    assert sent == ["placement.reconcile"]


def test_a_started_pass_lets_the_next_ask_queue_again(sent, now, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        queueing.queue_reconcile()
    reconcile_task(now=now.isoformat())
    assert not queueing.reconcile_queued()
    with django_capture_on_commit_callbacks(execute=True):
        queueing.queue_reconcile()
        queueing.queue_reconcile()
    assert sent == ["placement.reconcile", "placement.reconcile"]


def test_a_rolled_back_change_queues_nothing_and_holds_no_key(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        queueing.queue_reconcile()
    assert len(callbacks) == 1  # registered for the commit, which never came
    assert sent == []
    assert not queueing.reconcile_queued()


def test_a_broker_that_refuses_leaves_no_key(monkeypatch, django_capture_on_commit_callbacks):
    def refuse(name, *a, **kw):
        raise ConnectionError("broker down")

    monkeypatch.setattr(queueing.app, "send_task", refuse)
    with django_capture_on_commit_callbacks(execute=True):
        queueing.queue_reconcile()
    assert not queueing.reconcile_queued()


def test_the_embedded_file_cache_dedupes_alike(sent, tmp_path, django_capture_on_commit_callbacks):
    files = {"default": {"BACKEND": "llmgw.file_cache.FileCache", "LOCATION": str(tmp_path)}}
    with override_settings(CACHES=files):
        with django_capture_on_commit_callbacks(execute=True):
            queueing.queue_reconcile()
            queueing.queue_reconcile()
        assert sent == ["placement.reconcile"]
        queueing.reconcile_started()
        with django_capture_on_commit_callbacks(execute=True):
            queueing.queue_reconcile()
        assert sent == ["placement.reconcile", "placement.reconcile"]


def test_a_pass_cut_at_its_batch_queues_the_next_at_once(sent, now):
    # A thousand replicas asked for at once were four passes a beat tick apart; the rest follow at once.
    make_node("a", now=now)
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="big", served_model="big", profile=prof, replicas=BATCH_PER_PASS + 5)
    first = reconcile_task(now=now.isoformat())
    assert (first["created"], first["more"]) == (BATCH_PER_PASS, True)
    assert sent == ["placement.reconcile"] and queueing.reconcile_queued()
    # The next pass creates the last five and asks for nothing more.
    second = reconcile_task(now=now.isoformat())
    assert (second["created"], second["more"]) == (5, False)
    assert sent == ["placement.reconcile"] and not queueing.reconcile_queued()
