"""Resource rules: free GPUs, local disk, weights presence, allocations."""

import uuid

import pytest
from django.db import IntegrityError, transaction

import llmgw_wire as wire
from inventory import allocation, resources
from inventory.models import AllocatedGPU, Allocation, LocalWeights, Node, Storage
from tests.factories import gpu_payload, make_node

pytestmark = pytest.mark.django_db


def test_free_gpus_skip_allocated_and_unhealthy(now):
    cards = [gpu_payload(i) for i in range(8)]
    cards[2]["ecc_errors"] = 3
    cards[5]["problems"] = ["foreign process 4711 (python3) holds the card"]
    node = make_node("n1", now=now, gpus=cards)
    allocation.allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0, 1])
    assert allocation.free_gpus(node) == [3, 4, 6, 7]


def test_a_gpu_is_held_by_one_shard_only(now):
    make_node("n1", now=now)
    allocation.allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0, 1])
    with pytest.raises(IntegrityError), transaction.atomic():
        allocation.allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[1, 2])
    # Nothing of the refused claim was written.
    assert Allocation.objects.count() == 1
    assert sorted(AllocatedGPU.objects.values_list("gpu_index", flat=True)) == [0, 1]


def test_releasing_a_replica_releases_all_its_shards(now):
    make_node("n1", now=now)
    make_node("n2", now=now)
    replica, other = uuid.uuid4(), uuid.uuid4()
    allocation.allocate(node_id="n1", replica_id=replica, shard_id=uuid.uuid4(), gpu_indices=[0, 1, 2, 3], memory_gb=64)
    allocation.allocate(node_id="n2", replica_id=replica, shard_id=uuid.uuid4(), gpu_indices=[0, 1, 2, 3], memory_gb=64)
    allocation.allocate(node_id="n1", replica_id=other, shard_id=uuid.uuid4(), gpu_indices=[4], memory_gb=16)
    assert allocation.release_replica(replica) == 2
    assert list(Allocation.objects.values_list("replica_id", flat=True)) == [other]
    assert allocation.held_gpu_indices("n1") == [4]
    assert allocation.held_gpu_indices("n2") == []
    assert allocation.claimed_memory_gb("n1") == 16


def test_release_shard(now):
    make_node("n1", now=now)
    shard = uuid.uuid4()
    allocation.allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=shard, gpu_indices=[0])
    assert allocation.release_shard(shard) == 1
    assert allocation.release_shard(shard) == 0
    assert AllocatedGPU.objects.count() == 0


def test_claimed_memory_is_counted(now):
    make_node("n1", now=now)
    for _ in range(2):
        allocation.allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[], memory_gb=900)
    assert allocation.claimed_memory_gb("n1") == 1800


def test_negative_claims_are_refused_by_the_database(now):
    make_node("n1", now=now)
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), memory_gb=-1)


def test_local_disk_ignores_shared_filesystems(now):
    make_node(
        "n1",
        now=now,
        storage=[
            {"path": "/models", "free_bytes": 100, "total_bytes": 1000, "shared": False},
            {"path": "/scratch", "free_bytes": 50, "total_bytes": 500, "shared": False},
            {"path": "/mnt/filer", "free_bytes": 10**15, "total_bytes": 10**16, "shared": True, "fstype": "nfs4"},
        ],
    )
    assert resources.local_disk(Storage.objects.filter(node_id="n1")) == (150, 1500)


def test_local_disk_all_shared_or_unreported_is_unknown(now):
    make_node("n1", now=now, storage=[{"path": "/mnt/filer", "free_bytes": 5, "total_bytes": 9, "shared": True}])
    assert resources.local_disk(Storage.objects.filter(node_id="n1")) == (0, 0)
    assert resources.local_disk([]) == (0, 0)


def test_weights_presence_is_an_exact_path(now):
    make_node("n1", now=now, weights=[{"path": "/models/Llama-3.1-70B-Instruct", "size_bytes": 141 * 10**9}])
    weights = LocalWeights.objects.filter(node_id="n1")
    assert resources.has_weights(weights, "/models/Llama-3.1-70B-Instruct") is True
    assert resources.has_weights(weights, "/models/Llama-3.1-70B-Instruct/") is False
    assert resources.has_weights(weights, "/models/Llama-3.1-70B") is False
    assert resources.has_weights(weights, "meta-llama/Llama-3.1-70B-Instruct") is False


def test_a_node_that_never_looked_constrains_nothing(now):
    make_node("never-looked", now=now)
    make_node("looked-empty", now=now, weights=[])
    make_node("looked", now=now, weights=[{"path": "/models/x"}])
    nodes = {n.id: n for n in Node.objects.all()}
    assert resources.knows_its_weights(nodes["never-looked"].weights_reported) is False
    assert resources.knows_its_weights(nodes["looked-empty"].weights_reported) is True
    assert resources.knows_its_weights(nodes["looked"].weights_reported) is True


def test_wire_storage_none_is_not_empty():
    assert wire.Register(node_id="n").storage is None
    assert wire.Register(node_id="n", storage=[]).storage == []


def test_a_node_that_looked_and_found_nothing_knows_it_has_none():
    assert resources.knows_its_weights(True) is True
    assert resources.knows_its_weights(False) is False
