"""What the doctor's tests share: a check run over a fresh snapshot, NVLink nodes, the verdict's shape."""

from __future__ import annotations

from inventory import doctor
from inventory.doctor import Result
from tests.factories import gpu_payload, make_node

CLUSTER = "c1a5e7e2-7c9b-4d1a-9f1e-2b3c4d5e6f70"
JOINED = {"state": "Completed", "status": "Success", "cluster_uuid": CLUSTER, "clique_id": "7", "bandwidth": "Full"}
IB0 = [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400}]


def run(check, now, **kw):
    return check(doctor.load_inventory(now=now), **kw)


def nvl_node(node_id, now, *, fabrics=None, imex=None, **gpu_fabric):
    gpus = [gpu_payload(i, fabric={**JOINED, **gpu_fabric.get(f"g{i}", {})}) for i in range(4)]
    extra = {"imex": imex if imex is not None else {"state": "UP", "channels": 1}}
    return make_node(node_id, now=now, gpus=gpus, fabrics=fabrics or [], **extra)


def assert_result(r, result, nodes, details=None):
    assert (r.result, r.nodes) == (result, nodes)
    if details is not None:
        assert r.details == details
    if result != Result.PASS:
        assert r.action
