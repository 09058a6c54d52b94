"""Placement's metric families on /metrics: replicas of each deployment by state.

Registered with the inventory's collector (inventory.metrics.register) from
`PlacementConfig.ready()`.
"""

from __future__ import annotations

import datetime as dt

from django.db.models import Count

from inventory.metrics import Family, FamilySource
from placement.models import Deployment, Replica, ReplicaState


def families() -> list[Family]:
    """The families, empty."""
    return [Family("llmgw_replicas", "gauge", "Replicas of each deployment by state.", ("deployment", "state"))]


def fill(out: list[Family], now: dt.datetime) -> None:
    """Every deployment's replicas in every state, zeros included: two queries whatever their number."""
    (replicas,) = out
    deployments = list(Deployment.objects.values_list("id", "name"))
    counts = {
        (d, s): c
        for d, s, c in Replica.objects.values_list("deployment_id", "state").annotate(n=Count("id")).order_by()
    }
    for dep_id, name in deployments:
        for s in ReplicaState.values:
            replicas.rows.append(((name, s), float(counts.get((dep_id, s), 0))))


SOURCE = FamilySource(families, fill)
