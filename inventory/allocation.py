"""Allocations: which shard holds which GPUs, memory, cores and power of a node.

The database, not this module, is what makes a GPU held by one shard at a
time (the unique constraint on AllocatedGPU): two reconcilers racing for the
same card get an IntegrityError, never a double booking.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Sum

from inventory import changes
from inventory.models import AllocatedGPU, Allocation, Node
from inventory.resources import free_gpu_indices


def allocate(
    *,
    node_id: str,
    replica_id: uuid.UUID,
    shard_id: uuid.UUID,
    gpu_indices: Iterable[int],
    memory_gb: int = 0,
    cpu_cores: int = 0,
    power_w: float = 0.0,
) -> Allocation:
    """Record a shard's claim. Raises IntegrityError if any GPU is already held."""
    with transaction.atomic():
        alloc = Allocation.objects.create(
            node_id=node_id,
            replica_id=replica_id,
            shard_id=shard_id,
            memory_gb=memory_gb,
            cpu_cores=cpu_cores,
            power_w=power_w,
        )
        AllocatedGPU.objects.bulk_create(
            [AllocatedGPU(allocation=alloc, node_id=node_id, gpu_index=i) for i in sorted(set(gpu_indices))]
        )
        changes.mark([node_id], holdings=True)
    return alloc


def release_shard(shard_id: uuid.UUID) -> int:
    """Free what one shard held. Returns the number of allocations removed."""
    changes.mark(Allocation.objects.filter(shard_id=shard_id).values_list("node_id", flat=True), holdings=True)
    deleted, _ = Allocation.objects.filter(shard_id=shard_id).delete()
    return 1 if deleted else 0


def release_replica(replica_id: uuid.UUID) -> int:
    """Free every shard of a replica, on every node.

    Replicas are freed whole because they fail whole: one dead shard makes the
    others useless, and the replica is rebuilt rather than patched.
    """
    with transaction.atomic():
        held_on = list(Allocation.objects.filter(replica_id=replica_id).values_list("node_id", flat=True))
        Allocation.objects.filter(replica_id=replica_id).delete()
        changes.mark(held_on, holdings=True)
    return len(held_on)


def held_gpu_indices(node_id: str) -> list[int]:
    """The GPU indices of a node that some shard holds, sorted."""
    return sorted(AllocatedGPU.objects.filter(node_id=node_id).values_list("gpu_index", flat=True))


def free_gpus(node: Node) -> list[int]:
    """A node's GPUs that are neither allocated nor unhealthy, sorted."""
    return free_gpu_indices(node.gpus.all(), held_gpu_indices(node.id))


def claimed_memory_gb(node_id: str) -> int:
    """Host memory (GB) the node's shards have claimed."""
    return Allocation.objects.filter(node_id=node_id).aggregate(s=Sum("memory_gb"))["s"] or 0
