"""Placement's metric families on /metrics: replicas of each deployment by state, desired, waiting out a backoff.

Also the shards of replicas that span several nodes, by node: an InfiniBand
port of such a node carries the replica's collectives, so an alert on that
port joins on it (deploy/prometheus/).

Registered with the inventory's collector (inventory.metrics.register) from
`PlacementConfig.ready()`.
"""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, Q

from inventory.metrics import Family, FamilySource
from inventory.models import Node
from llmgw_wire import shard_states
from placement.models import Deployment, Replica, ReplicaState


def families() -> list[Family]:
    """The families, empty."""
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
    ]


def fill(out: list[Family], now: dt.datetime) -> None:
    """Every deployment's replicas in every state, zeros included, and the rest: three queries whatever their number."""
    replicas, desired, backoff, multinode = out
    deployments = list(Deployment.objects.order_by("name").values_list("id", "name", "replicas", "paused"))
    counts: dict[tuple[int, str], int] = {}
    waiting: dict[int, int] = {}
    for d, s, c, w in (
        Replica.objects.values_list("deployment_id", "state")
        .annotate(n=Count("id"), waiting=Count("id", filter=Q(state=ReplicaState.PENDING, not_before__gt=now)))
        .order_by()
    ):
        counts[(d, s)] = c
        waiting[d] = waiting.get(d, 0) + w
    for dep_id, name, want, paused in deployments:
        for s in ReplicaState.values:
            replicas.rows.append(((name, s), float(counts.get((dep_id, s), 0))))
        if not paused:
            desired.rows.append(((name,), float(want)))
        backoff.rows.append(((name,), float(waiting.get(dep_id, 0))))
    # Every node, 0 when it holds none: an alert joins on it, a panel sums it.
    live_wide = Q(shards__replica__deployment__profile__nodes__gt=1) & ~Q(shards__state__in=shard_states.TERMINAL)
    for node_id, n in Node.objects.order_by("id").annotate(n=Count("shards", filter=live_wide)).values_list("id", "n"):
        multinode.rows.append(((node_id,), float(n)))


SOURCE = FamilySource(families, fill)
