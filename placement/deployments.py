"""Operator actions on deployments: each recorded with who and why, each queueing a reconcile."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from inventory.models import Allocation
from placement import queueing, replicas
from placement.models import Deployment, PlacementEvent, Shard

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser


def record(dep: Deployment, kind: str, reason: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> None:
    """An operator's change to a deployment, as an event; a reconcile follows the commit."""
    replicas.event(kind, now=now, deployment_id=dep.id, reason=reason, actor=actor).save()
    queueing.queue_reconcile()


def live_replicas(dep: Deployment) -> int:
    """How many of a deployment's replicas are not yet stopped or failed."""
    return dep.replica_set.filter(state__in=replicas.LIVE_STATES).count()


def holding_replicas(dep: Deployment) -> int:
    """How many of a deployment's replicas hold something on a node: GPUs or cores, a port, a shard not over.

    A replica still pending that was never placed holds nothing, so it does
    not keep its deployment alive (a model no node fits must not need a
    scale to zero and a reconcile before it can be deleted).
    """
    live_shard = Shard.objects.filter(replica=OuterRef("pk")).exclude(state__in=replicas.SHARD_DONE)
    allocated = Allocation.objects.filter(replica_id=OuterRef("pk"))
    return (
        dep.replica_set.filter(state__in=replicas.LIVE_STATES)
        .filter(Q(Exists(live_shard)) | Q(Exists(allocated)))
        .count()
    )


def deletable(dep: Deployment) -> str:
    """Why a deployment cannot be deleted now, "" when it can.

    Deleting rows would orphan running shards and their GPUs: scale to zero
    first, and delete once the reconciler has stopped them. Replicas that
    hold nothing (pending, never placed) go with the deployment.
    """
    n = holding_replicas(dep)
    return f"{n} replicas still live: scale to 0 first" if n else ""


def scale(dep: Deployment, count: int, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> Deployment:
    """Set the desired replicas."""
    with transaction.atomic():
        before = Deployment.objects.select_for_update().values_list("replicas", flat=True).get(id=dep.id)
        Deployment.objects.filter(id=dep.id).update(replicas=count, updated_at=now)
        dep.replicas = count
        if before != count:
            record(dep, "scaled", f"replicas {before} -> {count}", now=now, actor=actor)
    return dep


def set_autoscale(
    dep: Deployment, policy: dict[str, Any], *, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> Deployment:
    """Change a deployment's autoscaling policy (validated by the caller), recorded field by field.

    Turning it off leaves the replicas at the count the autoscaler last set.
    """
    with transaction.atomic():
        before = Deployment.objects.select_for_update().get(id=dep.id)
        for key, value in policy.items():
            setattr(dep, key, value)
        diff = [
            f"{key} {getattr(before, key)!r} -> {value!r}"
            for key, value in policy.items()
            if getattr(before, key) != value
        ]
        if diff:
            Deployment.objects.filter(id=dep.id).update(updated_at=now, **policy)
            record(dep, "autoscale_policy", ", ".join(diff), now=now, actor=actor)
    return dep


def changed(before: Deployment | None, after: Deployment) -> str:
    """What an operator's save changed, field by field ("" when nothing did)."""
    if before is None:
        return "created"
    out = []
    for f in Deployment._meta.concrete_fields:
        if not f.editable or f.primary_key or f.name in ("created_at", "updated_at"):
            continue
        old, new = f.value_from_object(before), f.value_from_object(after)
        if old != new:
            out.append(f"{f.name} {old!r} -> {new!r}")
    return ", ".join(out)


def set_paused(dep: Deployment, paused: bool, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> Deployment:
    """Pause (the reconciler leaves it alone, what runs keeps running) or resume."""
    with transaction.atomic():
        changed = Deployment.objects.filter(id=dep.id, paused=not paused).update(paused=paused, updated_at=now)
        dep.paused = paused
        if changed:
            record(dep, "paused" if paused else "resumed", "", now=now, actor=actor)
    return dep


def delete(dep: Deployment, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> str:
    """Delete a deployment whose replicas are all stopped, recording who and when; returns why not, or "".

    Its events and its replicas' events stay, naming it: an incident review
    looks for exactly the history of what was deleted.
    """
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().filter(id=dep.id).first()
        if locked is None:
            return "already deleted"
        why = deletable(locked)
        if why:
            return why
        PlacementEvent.objects.filter(deployment_id=dep.id).update(deployment_name=locked.name)
        PlacementEvent.objects.filter(replica__deployment_id=dep.id).update(deployment_name=locked.name)
        gone = replicas.event(
            "deleted",
            now=now,
            reason=f"deleted: deployment {locked.name} (model {locked.served_model}, profile {locked.profile})",
            actor=actor,
        )
        gone.deployment_name = locked.name
        gone.save(force_insert=True)
        locked.delete()
    return ""
