"""Queueing a reconcile pass once the caller's transaction commits.

Everything that changes what the reconciler decides from (a deployment
edited, a node lost, a shard failed) asks for a pass here rather than waiting
for beat. It looks the task up by name in the Celery app, so that the
modules that queue a pass never import the reconciler they queue.
"""

from __future__ import annotations

from celery import current_app
from django.db import transaction

TASK_NAME = "placement.reconcile"


def queue_reconcile() -> bool:
    """Ask the reconciler to run once this transaction commits; False where no reconcile task is registered.

    Robust: the change that asked for a pass is committed already, so a broker
    that is down is logged, not raised at the caller; beat's next pass catches up.
    """
    task = current_app.tasks.get(TASK_NAME)
    if task is None:
        return False
    transaction.on_commit(lambda: task.apply_async(), robust=True)
    return True
