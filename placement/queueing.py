"""Queueing reconcile passes: at most one waiting to start, however many changes ask.

Every shard state change, lost node and deployment edit asks for a pass. A
pass looks at everything, so one waiting pass answers all the asks made
before it starts: at 1,000 nodes, queueing one per ask piled up hundreds of
identical passes behind each other. The first ask takes a cache key (an
atomic add, on Redis and on the file cache of the embedded default alike)
and queues the task; later asks find the key and queue nothing. The task
drops the key as it starts, so a change made during a pass (which that pass
may have read too early to see) queues exactly one more.

A pass asked for while another runs finds the reconcile lock held and
ends at once; the running pass may have read before the change it was asked
for, so the skipped one leaves a mark, AGAIN_KEY, and the running pass asks
for one more on its way out. With two worker children this is the common
case, not a corner: the second child takes the queued task while the first
runs a pass, and a scale-up or a shard reported ready waited for beat's next
tick (2 s at the defaults) before any pass saw it.

The key expires on its own, so a queued task that never ran (a broker
purge, a worker killed before it took the message) silences asks for at
most QUEUED_TTL_S; beat's periodic pass covers the gap meanwhile.
"""

from __future__ import annotations

import logging

from celery import current_app as app
from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)

# The task is asked for by name, so the modules that queue a pass never import
# the reconciler they queue.
TASK_NAME = "placement.reconcile"
QUEUED_KEY = "placement:reconcile:queued"
QUEUED_TTL_S = 120
# Left by a pass that found another running: the running one asks for one more as it ends.
AGAIN_KEY = "placement:reconcile:again"


def queue_reconcile(*, reason: str = "") -> bool:
    """Ask for a reconcile pass once the caller's transaction commits; True when asked.

    Nothing is queued when a pass is already waiting to start: that one
    will see this change. `reason` is logged with the pass that is queued.
    Asked after the commit, so a rolled-back change neither queues a pass
    nor holds the key.
    """
    transaction.on_commit(lambda: _send(reason), robust=True)
    return True


def ask_now(reason: str = "") -> bool:
    """Ask for a pass at once, outside any transaction (a gateway holding a request for a model at zero)."""
    return _send(reason)


def _send(reason: str) -> bool:
    """Queue the task unless one is waiting; True when this call queued it."""
    try:
        first = cache.add(QUEUED_KEY, reason or "queued", timeout=QUEUED_TTL_S)
    except Exception:
        # A cache that cannot answer must not stop placement: a duplicate pass
        # is harmless (single-flight), a missing one leaves replicas unplaced.
        log.warning("reconcile queue key unavailable; queueing anyway", exc_info=True)
        first = True
    if not first:
        return False
    try:
        app.send_task(TASK_NAME)
    except Exception:
        # Not queued: the next ask must not find the key and give up.
        cache.delete(QUEUED_KEY)
        raise
    log.debug("reconcile queued (%s)", reason or "no reason given")
    return True


def reconcile_started() -> None:
    """Called by the task as it starts: the next ask queues a new pass."""
    try:
        cache.delete(QUEUED_KEY)
    except Exception:
        log.warning("reconcile queue key unavailable; it expires by itself", exc_info=True)


def reconcile_queued() -> bool:
    """Whether a pass is queued and not yet started (for the doctor and tests)."""
    return cache.get(QUEUED_KEY) is not None


def ask_after_running() -> None:
    """Mark that a pass was asked for while another ran: the running one asks again as it ends."""
    try:
        cache.set(AGAIN_KEY, 1, timeout=QUEUED_TTL_S)
    except Exception:
        # Beat's periodic pass is the net: a mark not left delays the change by one tick, never loses it.
        log.warning("reconcile queue key unavailable; the next periodic pass covers it", exc_info=True)


def take_ask_after() -> bool:
    """Clear the mark ask_after_running() left; whether there was one (a pass is owed)."""
    try:
        return bool(cache.delete(AGAIN_KEY))
    except Exception:
        log.warning("reconcile queue key unavailable; it expires by itself", exc_info=True)
        return False
