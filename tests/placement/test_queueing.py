"""One reconcile pass waiting at a time, however many changes ask for one."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import override_settings

from llmgw import locks
from placement import queueing, reconciler
from placement.models import Deployment, EngineProfile
from placement.reconciler import BATCH_PER_PASS
from placement.tasks import LOCK_NAME, reconcile_task
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
    # A scale-up past the bound of a pass was passes a beat tick apart; the rest now follow at once.
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


def _another_holder() -> locks.HeldLock:
    """Another worker process holding the reconcile lock; its close() unlocks first, as a pass ending does.

    Not a bare session closed: the server lets a closed session's locks go only once it has seen the
    close, which under CI's load came after the next pass had found the lock still held.
    """
    holder = locks.HeldLock(LOCK_NAME)
    assert holder.held()
    return holder


def test_a_pass_asked_for_while_another_runs_is_asked_again_as_that_one_ends(sent, now, monkeypatch):
    # Two worker children: the second takes the queued task while the first runs a pass that may have
    # read before the change. Skipped, and nothing else asking, the change waited for beat's next tick.
    make_node("a", now=now)
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="one", served_model="one", profile=prof, replicas=1)
    real = reconciler.reconcile
    skipped: list[dict | None] = []

    def with_a_second_child(*, now):
        report = real(now=now)
        # The other child, on a session of its own, while this pass still holds the lock.
        child = threading.Thread(target=lambda: (skipped.append(reconcile_task(now=now)), connection.close()))
        child.start()
        child.join()
        return report

    monkeypatch.setattr(reconciler, "reconcile", with_a_second_child)
    first = reconcile_task(now=now.isoformat())
    assert skipped == [None]
    assert (first["placed"], first["more"]) == (1, False)
    assert sent == ["placement.reconcile"]
    assert not queueing.take_ask_after()  # the mark was answered, not left for later


def test_a_skipped_pass_leaves_a_mark_that_the_next_pass_answers(sent, now):
    other = _another_holder()
    try:
        assert reconcile_task(now=now.isoformat()) is None
        assert sent == []
    finally:
        other.close()
    # The holder's own end asks for the pass (above); one started meanwhile reads everything, so it
    # answers the mark itself and asks for nothing more.
    assert reconcile_task(now=now.isoformat()) is not None
    assert sent == []
    assert not queueing.take_ask_after()


def test_a_skipped_pass_runs_itself_when_the_holder_ended_before_the_mark(sent, now, monkeypatch):
    # The race the second try closes: the running pass looked for a mark, found none and let its lock go,
    # and only then did the skipped one leave its mark. Nobody would ask; the skipped one runs instead.
    make_node("a", now=now)
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="one", served_model="one", profile=prof, replicas=1)
    other = _another_holder()
    mark = queueing.ask_after_running

    def holder_ends_first() -> None:
        other.close()
        mark()

    monkeypatch.setattr(queueing, "ask_after_running", holder_ends_first)
    report = reconcile_task(now=now.isoformat())
    assert report is not None and report["placed"] == 1
    assert sent == []
    assert not queueing.take_ask_after()
