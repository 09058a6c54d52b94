"""Placement's metric families on /metrics: replicas of each deployment by state, and the autoscaler's view.

Registered with the inventory's collector (inventory.metrics.register) from
`PlacementConfig.ready()`.
"""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, OuterRef, Subquery

from inventory.metrics import Family, FamilySource
from placement.models import AutoscaleSample, Deployment, PlacementEvent, Replica, ReplicaState


def families() -> list[Family]:
    """The families, empty."""
    return [
        Family("llmgw_replicas", "gauge", "Replicas of each deployment by state.", ("deployment", "state")),
        Family(
            "llmgw_autoscale_desired_replicas",
            "gauge",
            "Replicas the autoscaler set for each autoscaled deployment.",
            ("deployment",),
        ),
        Family(
            "llmgw_autoscale_recommended_replicas",
            "gauge",
            "Replicas the load alone asked for at the last pass, before the windows.",
            ("deployment",),
        ),
        Family(
            "llmgw_autoscale_signal",
            "gauge",
            "The autoscaling metric at the last pass (per replica; seconds for TTFT).",
            ("deployment", "metric"),
        ),
        Family(
            "llmgw_autoscale_held_requests",
            "gauge",
            "Requests held by the gateways at the last pass (no replica ready).",
            ("deployment",),
        ),
        Family(
            "llmgw_autoscale_steps",
            "counter",
            "Changes of the replica count the autoscaler made (its events, as kept).",
            ("deployment",),
        ),
    ]


def fill(out: list[Family], now: dt.datetime) -> None:
    """Every deployment's replicas in every state, zeros included, and the autoscaler's last look.

    Two queries whatever their number, two more when a deployment is autoscaled.
    """
    replicas, desired, recommended, signal, held, steps = out
    deployments = list(Deployment.objects.values_list("id", "name", "autoscale_metric", "replicas"))
    counts = {
        (d, s): c
        for d, s, c in Replica.objects.values_list("deployment_id", "state").annotate(n=Count("id")).order_by()
    }
    for dep_id, name, _, _ in deployments:
        for s in ReplicaState.values:
            replicas.rows.append(((name, s), float(counts.get((dep_id, s), 0))))
    auto = {dep_id: (name, metric, n) for dep_id, name, metric, n in deployments if metric}
    if not auto:
        return
    latest = AutoscaleSample.objects.filter(deployment_id=OuterRef("id")).order_by("-at", "-id")
    last = {
        dep_id: (rec, value, waiting)
        for dep_id, rec, value, waiting in Deployment.objects.filter(id__in=list(auto))
        .annotate(
            rec=Subquery(latest.values("recommended")[:1]),
            value=Subquery(latest.values("signal")[:1]),
            waiting=Subquery(latest.values("held")[:1]),
        )
        .values_list("id", "rec", "value", "waiting")
        if rec is not None
    }
    made = dict(
        PlacementEvent.objects.filter(deployment_id__in=list(auto), kind="autoscaled")
        .values_list("deployment_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    for dep_id, (name, metric, n) in auto.items():
        desired.rows.append(((name,), float(n)))
        steps.rows.append(((name,), float(made.get(dep_id, 0))))
        if dep_id in last:
            rec, value, waiting = last[dep_id]
            recommended.rows.append(((name,), float(rec)))
            held.rows.append(((name,), float(waiting)))
            if value is not None:
                signal.rows.append(((name, metric), float(value)))


SOURCE = FamilySource(families, fill)
