"""What the inventory asks of whatever runs work on its nodes, without importing it.

The inventory knows nodes, not replicas; yet losing a node must fail the
shards on it, a drain must list what it will move, and a node still holding
shards may not be forgotten. Those answers belong to placement, which sits
above the inventory: it fills this one registry from `PlacementConfig.ready()`
(placement/workloads.py), so the imports run one way.

A missing registration raises rather than answering "nothing runs here": a
liveness sweep that silently failed no shard, or a forget that silently
dropped a node with shards, would be wrong in the quiet way that costs most.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from inventory.models import Node
    from inventory.operations import AffectedReplica


class Workloads(Protocol):
    """The questions the inventory asks about the work placed on its nodes."""

    def fail_node(self, node_id: str, *, reason: str, now: dt.datetime) -> list[str]:
        """Fail every live shard on a lost node, ask for a reconcile when any failed; the failed shard ids."""
        ...

    def nodes_with_live_shards(self) -> QuerySet[Any]:
        """The node ids holding a shard not yet over, as a subquery (`.values("node_id")`)."""
        ...

    def live_replicas(self, node_ids: Iterable[str]) -> dict[str, list[AffectedReplica]]:
        """The replicas with a live shard on each node, by node id (what a drain moves)."""
        ...

    def shard_count(self, node_id: str) -> int:
        """How many shards not yet stopped or failed a node holds."""
        ...

    def forget_node(self, node_id: str) -> None:
        """Let go of a node about to be forgotten: remove its stopped and failed shards, keep their history."""
        ...

    def node_shards(self, node: Node) -> list[Any]:
        """A node's shards with their replica and deployment, newest first (the node page's list)."""
        ...


_workloads: Workloads | None = None


def register_workloads(impl: Workloads) -> None:
    """Install the one implementation (placement's AppConfig.ready); a second, different one is refused."""
    global _workloads
    if _workloads is not None and _workloads is not impl:
        raise ImproperlyConfigured(f"inventory workloads already registered by {_workloads!r}")
    _workloads = impl


def workloads() -> Workloads:
    """The registered implementation; raises when none is (placement is not installed or not ready)."""
    if _workloads is None:
        raise ImproperlyConfigured(
            "no inventory workloads registered: placement's AppConfig.ready() registers them "
            "(is 'placement' in INSTALLED_APPS?)"
        )
    return _workloads
