"""Placement's doctor checks: replicas waiting for a place.

Registered with the inventory's doctor (inventory.doctor.register) from
`PlacementConfig.ready()`, after the inventory's own checks.
"""

from __future__ import annotations

from inventory.doctor import CheckResult, Inventory, Result
from placement.models import Replica, ReplicaState

_PENDING = "placement.pending_replicas"


def load_pending_replicas(inv: Inventory) -> None:
    """The pending replicas with their deployment, oldest first: one query per doctor run."""
    inv.extra[_PENDING] = list(
        Replica.objects.filter(state=ReplicaState.PENDING).select_related("deployment").order_by("created_at")
    )


def check_replicas_pending(inv: Inventory) -> CheckResult:
    """Replicas waiting for a place, with the planner's reason."""
    if not inv.extra[_PENDING]:
        return CheckResult("replicas_pending", Result.PASS, "no replica is waiting for a place")
    details = [
        f"{r.deployment.name}/{str(r.id)[:8]}: {r.reason or 'no reason recorded yet'}" for r in inv.extra[_PENDING]
    ]
    return CheckResult(
        "replicas_pending",
        Result.WARN,
        f"{len(details)} replica(s) pending",
        "the reason says what is missing (free GPUs, a fabric, memory, power): free capacity, uncordon "
        "nodes, or change the deployment's profile or selector",
        [],
        details,
    )
