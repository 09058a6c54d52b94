"""The liveness sweep: nodes whose heartbeats stopped become unreachable, then lost.

ready -> unreachable after LLMGW_UNREACHABLE_AFTER without a heartbeat,
unreachable -> lost after LLMGW_LOST_AFTER. Lost means its replicas are dead:
their shards are marked failed so the reconciler releases those replicas whole
and rebuilds them elsewhere. Cordoned and draining nodes keep the operator's
state, but get `unreachable_since`, so the operator sees they are silent, and
their shards are failed after the same lost delay: a cordon does not keep a
dead machine's models alive.

Every move is a compare-and-set under the node's row lock that re-checks the
node is still silent, so a heartbeat arriving mid-sweep wins.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction

from inventory.models import OPERATOR_STATES, Node, NodeState
from inventory.nodes import change_state, record_event

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """The nodes a sweep moved or flagged."""

    unreachable: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)
    failed_shards: list[str] = field(default_factory=list)


def _silent_for(seconds: float, *, now: dt.datetime) -> dt.datetime:
    return now - dt.timedelta(seconds=seconds)


def _silence(now: dt.datetime, cutoff: dt.datetime) -> str:
    # What the node's history says: the delay the node overstayed.
    return f"no heartbeat for {int((now - cutoff).total_seconds())} s"


def _lock_if_silent(node_id: str, state: str, cutoff: dt.datetime) -> bool:
    return (
        Node.objects.select_for_update()
        .filter(id=node_id, state=state, last_seen__lt=cutoff)
        .values_list("id", flat=True)
        .first()
        is not None
    )


def mark_unreachable(node_id: str, *, now: dt.datetime, cutoff: dt.datetime) -> bool:
    """ready -> unreachable, if the node is still ready and still silent since before `cutoff`."""
    with transaction.atomic():
        if not _lock_if_silent(node_id, NodeState.READY, cutoff):
            return False
        if not change_state(
            node_id,
            NodeState.UNREACHABLE,
            now=now,
            expected=NodeState.READY,
            reason=_silence(now, cutoff),
            actor_name="system",
        ):
            return False
        Node.objects.filter(id=node_id, unreachable_since__isnull=True).update(unreachable_since=now)
    return True


def mark_lost(node_id: str, *, now: dt.datetime, cutoff: dt.datetime) -> list[str] | None:
    """unreachable -> lost and its shards failed; None when the node came back or moved meanwhile."""
    from placement import agent_sync

    with transaction.atomic():
        if not _lock_if_silent(node_id, NodeState.UNREACHABLE, cutoff):
            return None
        change_state(
            node_id,
            NodeState.LOST,
            now=now,
            expected=NodeState.UNREACHABLE,
            reason=_silence(now, cutoff),
            actor_name="system",
        )
        failed = agent_sync.fail_node_shards(node_id, reason="node lost", now=now)
        if failed:
            agent_sync.queue_reconcile()
    return failed


def flag_operator_node(node_id: str, state: str, *, now: dt.datetime, cutoff: dt.datetime) -> bool:
    """A silent cordoned or draining node keeps its state; `unreachable_since` says it is silent."""
    with transaction.atomic():
        if not Node.objects.filter(
            id=node_id, state=state, last_seen__lt=cutoff, unreachable_since__isnull=True
        ).update(unreachable_since=now):
            return False
        record_event(
            node_id,
            "unreachable",
            f"{_silence(now, cutoff)}; stays {state}",
            now=now,
            actor_name="system",
        )
    return True


def fail_silent_operator_node(node_id: str, state: str, *, now: dt.datetime, cutoff: dt.datetime) -> list[str]:
    """A cordoned or draining node silent past the lost delay: its shards are dead, its state stays."""
    from placement import agent_sync

    with transaction.atomic():
        if not _lock_if_silent(node_id, state, cutoff):
            return []
        failed = agent_sync.fail_node_shards(node_id, reason="node lost", now=now)
        if failed:
            agent_sync.queue_reconcile()
    return failed


def sweep(*, now: dt.datetime) -> SweepResult:
    """Move silent nodes along ready -> unreachable -> lost; flag silent cordoned and draining ones.

    Each node is its own transaction, so one failure does not hold back the
    rest, and a sweep that found a node silent for the lost delay moves it
    both steps at once (beat was down, say).
    """
    result = SweepResult()
    unreachable_cutoff = _silent_for(settings.LLMGW_UNREACHABLE_AFTER, now=now)
    lost_cutoff = _silent_for(settings.LLMGW_LOST_AFTER, now=now)
    for node_id in Node.objects.filter(state=NodeState.READY, last_seen__lt=unreachable_cutoff).values_list(
        "id", flat=True
    ):
        if mark_unreachable(node_id, now=now, cutoff=unreachable_cutoff):
            result.unreachable.append(node_id)
    for node_id in Node.objects.filter(state=NodeState.UNREACHABLE, last_seen__lt=lost_cutoff).values_list(
        "id", flat=True
    ):
        failed = mark_lost(node_id, now=now, cutoff=lost_cutoff)
        if failed is not None:
            result.lost.append(node_id)
            result.failed_shards.extend(failed)
    for node_id, state in Node.objects.filter(
        state__in=OPERATOR_STATES, last_seen__lt=unreachable_cutoff, unreachable_since__isnull=True
    ).values_list("id", "state"):
        if flag_operator_node(node_id, state, now=now, cutoff=unreachable_cutoff):
            result.flagged.append(node_id)
    from placement.agent_sync import TERMINAL
    from placement.models import Shard

    # Only those with a shard not yet over: one query, not one per silent node.
    silent_with_shards = Node.objects.filter(
        state__in=OPERATOR_STATES,
        last_seen__lt=lost_cutoff,
        id__in=Shard.objects.exclude(state__in=TERMINAL).values("node_id"),
    ).values_list("id", "state")
    for node_id, state in silent_with_shards:
        result.failed_shards.extend(fail_silent_operator_node(node_id, state, now=now, cutoff=lost_cutoff))
    if result.unreachable or result.lost or result.flagged:
        log.info(
            "liveness: %d unreachable, %d lost, %d flagged, %d shards failed",
            len(result.unreachable),
            len(result.lost),
            len(result.flagged),
            len(result.failed_shards),
        )
    return result
