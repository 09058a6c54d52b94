"""Queueing a reconcile pass after the caller's transaction commits."""

from __future__ import annotations

import pytest

from llmgw.celery import app
from placement import queueing

pytestmark = pytest.mark.django_db


def test_queue_reconcile_only_when_the_reconciler_exists(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        queued = queueing.queue_reconcile()
    assert queued == ("placement.reconcile" in app.tasks)
    assert len(callbacks) == (1 if queued else 0)
