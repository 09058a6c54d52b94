"""Replica and shard state changes: compare-and-set moves, each leaving an event row.

A replica moves only along REPLICA_TRANSITIONS; a batch of replicas moves
in one statement and one bulk insert of events, so a reconcile pass costs a
number of queries that does not grow with the deployments it looks at.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from django.db import transaction

from llmgw import logs
from llmgw_wire import shard_states
from placement.models import REPLICA_TRANSITIONS, PlacementEvent, Replica, ReplicaState
from placement.signals import replicas_changed

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

log = logging.getLogger(__name__)

LIVE_STATES = frozenset(
    {
        ReplicaState.PENDING,
        ReplicaState.PLACING,
        ReplicaState.STARTING,
        ReplicaState.READY,
        ReplicaState.DEGRADED,
        ReplicaState.DRAINING,
    }
)
# A shard in these states is done; the others are, or are becoming, a process.
SHARD_DONE = shard_states.TERMINAL
SHARD_TRANSITIONS = shard_states.TRANSITIONS


class TransitionError(Exception):
    """A move the current state never allows."""


def event(kind: str, **fields: Any) -> PlacementEvent:
    """An unsaved event row (bulk-inserted by the caller), and its INFO line once the caller commits; `fields`
    are event_row's."""
    return PlacementEvent(**event_row(kind, **fields))


def event_row(
    kind: str,
    *,
    now: dt.datetime,
    deployment_id: int | None = None,
    replica_id: uuid.UUID | None = None,
    shard_id: uuid.UUID | None = None,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    actor: AbstractBaseUser | None = None,
) -> dict[str, Any]:
    """The same event as its columns, for writers of a thousand at once (llmgw.db.insert_rows); its INFO line
    once the caller commits."""
    name = actor.get_username() if actor is not None else "system"
    subject = f"replica {replica_id} (deployment {deployment_id})" if replica_id else f"deployment {deployment_id}"
    change = f"{from_state} -> {to_state}" if from_state and to_state else f"{kind}, {to_state}" if to_state else kind
    logs.after_commit(log, "%s: %s%s (by %s)", subject, change, f": {reason}" if reason else "", name)
    return {
        "at": now,
        "deployment_id": deployment_id,
        "replica_id": replica_id,
        "shard_id": shard_id,
        "kind": kind,
        "from_state": from_state,
        "to_state": to_state,
        "reason": reason,
        "actor_id": actor.pk if actor is not None else None,
        "actor_name": name,
    }


def move(
    replica_ids: Iterable[uuid.UUID],
    old: str,
    new: str,
    *,
    now: dt.datetime,
    reason: str = "",
    fields: Mapping[str, Any] | None = None,
    actor: AbstractBaseUser | None = None,
) -> list[uuid.UUID]:
    """Move replicas from `old` to `new`, those still in `old`; returns those moved.

    Rows locked and re-read in `old` first, so a concurrent writer that moved
    one away is not overwritten, and each moved replica gets its event.
    """
    if new not in REPLICA_TRANSITIONS[ReplicaState(old)]:
        raise TransitionError(f"a replica cannot go from {old} to {new}")
    ids = list(replica_ids)
    if not ids:
        return []
    with transaction.atomic():
        rows = list(
            Replica.objects.select_for_update()
            .filter(id__in=ids, state=old)
            .order_by("id")
            .values_list("id", "deployment_id")
        )
        if not rows:
            return []
        moved = [r[0] for r in rows]
        Replica.objects.filter(id__in=moved).update(state=new, reason=reason, updated_at=now, **dict(fields or {}))
        PlacementEvent.objects.bulk_create(
            [
                event(
                    "state",
                    now=now,
                    deployment_id=dep,
                    replica_id=rid,
                    from_state=old,
                    to_state=new,
                    reason=reason,
                    actor=actor,
                )
                for rid, dep in rows
            ]
        )
        # Routers stop sending to a retired replica as soon as the move is visible.
        transaction.on_commit(lambda: replicas_changed.send(sender=Replica, replica_ids=moved))
    return moved


def change_state(
    replica: Replica,
    new: str,
    *,
    now: dt.datetime,
    reason: str = "",
    actor: AbstractBaseUser | None = None,
    **fields: Any,
) -> bool:
    """Move one replica from the state it was read in; False if it had moved meanwhile."""
    moved = move([replica.id], replica.state, new, now=now, reason=reason, fields=fields, actor=actor)
    if moved:
        replica.state = new
        replica.reason = reason
        for k, v in fields.items():
            setattr(replica, k, v)
    return bool(moved)
