"""Placement's answers to the inventory's questions about work on its nodes (inventory/hooks.py).

Registered from `PlacementConfig.ready()`: the inventory calls these without
importing placement, so the imports run one way.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet

from inventory.models import Node
from inventory.operations import AffectedReplica
from placement import agent_sync, queueing
from placement.models import Shard

# Shards in these states hold nothing any more: a drain has nothing left to move.
FINISHED_SHARD_STATES = frozenset({"stopped", "failed"})


class PlacementWorkloads:
    """The shards placement keeps on each node, as the inventory asks about them."""

    def fail_node(self, node_id: str, *, reason: str, now: dt.datetime) -> list[str]:
        """Fail the node's live shards and queue a reconcile when any failed, so their replicas are rebuilt."""
        failed = agent_sync.fail_node_shards(node_id, reason=reason, now=now)
        if failed:
            queueing.queue_reconcile()
        return failed

    def nodes_with_live_shards(self) -> QuerySet[Any]:
        """Node ids with a shard not yet over, as a subquery: one query, not one per silent node."""
        return Shard.objects.exclude(state__in=agent_sync.TERMINAL).values("node_id")

    def live_replicas(self, node_ids: Iterable[str]) -> dict[str, list[AffectedReplica]]:
        """The replicas with a shard not stopped or failed on each node, by node id."""
        ids = list(node_ids)
        out: dict[str, dict[str, dict]] = {i: {} for i in ids}
        rows = (
            Shard.objects.filter(node_id__in=ids)
            .exclude(state__in=FINISHED_SHARD_STATES)
            .select_related("replica__deployment")
            .order_by("node_id", "replica__deployment__name", "replica_id", "rank")
        )
        for s in rows:
            entry = out[s.node_id].setdefault(
                str(s.replica_id),
                {"deployment": s.replica.deployment.name, "state": s.replica.state, "shards": []},
            )
            entry["shards"].append(f"rank {s.rank} ({s.state}, GPUs {','.join(map(str, s.gpu_indices)) or '-'})")
        return {
            node_id: [
                AffectedReplica(rid, e["deployment"], e["state"], tuple(e["shards"])) for rid, e in replicas.items()
            ]
            for node_id, replicas in out.items()
        }

    def shard_count(self, node_id: str) -> int:
        """The node's shards not yet stopped or failed: while any is left, forgetting the node is refused."""
        return Shard.objects.filter(node_id=node_id).exclude(state__in=FINISHED_SHARD_STATES).count()

    def forget_node(self, node_id: str) -> None:
        """Remove the node's stopped and failed shards (the node is being forgotten).

        Their events stay (the shard link goes null), as do their replicas:
        what ran there is still told by the placement history.
        """
        Shard.objects.filter(node_id=node_id, state__in=FINISHED_SHARD_STATES).delete()

    def node_shards(self, node: Node) -> list[Any]:
        """The node's shards with replica and deployment, newest first."""
        return list(Shard.objects.filter(node=node).select_related("replica__deployment").order_by("-created_at"))


WORKLOADS = PlacementWorkloads()
