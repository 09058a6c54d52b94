"""Placement's metric families on /metrics: replicas of each deployment by state, desired, waiting out a backoff.

Also the shards of replicas that span several nodes, by node: an InfiniBand
port of such a node carries the replica's collectives, so an alert on that
port joins on it (deploy/prometheus/); and the autoscaler's last look at each
autoscaled deployment.

Registered with the inventory's collector (inventory.metrics.register) from
`PlacementConfig.ready()`.
"""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, OuterRef, Q, Subquery

from inventory.metrics import Family, FamilySource
from inventory.models import Node
from llmgw_wire import shard_states
from placement.models import AutoscaleSample, Deployment, PlacementEvent, Replica, ReplicaState


def families() -> list[Family]:
    """Placement's families, in the order they are written."""
    return [
        Family("llmgw_replicas", "gauge", "Replicas of each deployment by state.", ("deployment", "state")),
        Family(
            "llmgw_deployment_replicas_desired",
            "gauge",
            "Replicas the reconciler keeps (paused deployments are not written).",
            ("deployment",),
        ),
        Family(
            "llmgw_deployment_start_backoff",
            "gauge",
            "Pending replicas waiting out a backoff after failed starts or placements.",
            ("deployment",),
        ),
        Family(
            "llmgw_node_multinode_shards",
            "gauge",
            "Live shards on the node of replicas that span several nodes (0 for every other node).",
            ("node",),
        ),
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
    """Every deployment's replicas in every state, zeros included, and the rest.

    Three queries whatever their number, two more when a deployment is autoscaled.
    """
    replicas, desired, backoff, multinode, auto_desired, recommended, signal, held, steps = out
    deployments = list(
        Deployment.objects.order_by("name").values_list("id", "name", "replicas", "paused", "autoscale_metric")
    )
    counts: dict[tuple[int, str], int] = {}
    waiting: dict[int, int] = {}
    for d, s, c, w in (
        Replica.objects.values_list("deployment_id", "state")
        .annotate(n=Count("id"), waiting=Count("id", filter=Q(state=ReplicaState.PENDING, not_before__gt=now)))
        .order_by()
    ):
        counts[(d, s)] = c
        waiting[d] = waiting.get(d, 0) + w
    for dep_id, name, want, paused, _ in deployments:
        for s in ReplicaState.values:
            replicas.rows.append(((name, s), float(counts.get((dep_id, s), 0))))
        if not paused:
            desired.rows.append(((name,), float(want)))
        backoff.rows.append(((name,), float(waiting.get(dep_id, 0))))
    # Every node, 0 when it holds none: an alert joins on it, a panel sums it.
    live_wide = Q(shards__replica__deployment__profile__nodes__gt=1) & ~Q(shards__state__in=shard_states.TERMINAL)
    for node_id, n in Node.objects.order_by("id").annotate(n=Count("shards", filter=live_wide)).values_list("id", "n"):
        multinode.rows.append(((node_id,), float(n)))
    _fill_autoscale(
        {dep_id: (name, metric, n) for dep_id, name, n, _, metric in deployments if metric},
        auto_desired,
        recommended,
        signal,
        held,
        steps,
    )


def _fill_autoscale(
    auto: dict[int, tuple[str, str, int]],
    desired: Family,
    recommended: Family,
    signal: Family,
    held: Family,
    steps: Family,
) -> None:
    """The autoscaler's last look at each autoscaled deployment: two queries, none when there is none."""
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
