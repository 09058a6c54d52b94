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
    """Replicas waiting for a place, with the planner's reason, or the failed start they back off from.

    A replica backing off after failed starts carries the last failure's
    reason, which names the engine's own error ("the engine exited with code
    1: OSError: [Errno 98] Address already in use"): that, not the exit code,
    is what an operator can act on.
    """
    pending = inv.extra[_PENDING]
    if not pending:
        return CheckResult("replicas_pending", Result.PASS, "no replica is waiting for a place")
    details = [f"{r.deployment.name}/{str(r.id)[:8]}: {r.reason or 'no reason recorded yet'}" for r in pending]
    backing_off = sum(1 for r in pending if r.not_before is not None and r.not_before > inv.now)
    summary = f"{len(details)} replica(s) pending"
    action = (
        "the reason says what is missing (free GPUs, a fabric, memory, power): free capacity, uncordon "
        "nodes, or change the deployment's profile or selector"
    )
    if backing_off:
        summary += f", {backing_off} backing off after failed starts"
        action += (
            "; a replica backing off after failed starts ends with what its engine said: fix that (a port in "
            "use, a bad argument, missing weights); the failed shard's output_tail (API, admin) holds the end "
            "of its log"
        )
    return CheckResult("replicas_pending", Result.WARN, summary, action, [], details)
