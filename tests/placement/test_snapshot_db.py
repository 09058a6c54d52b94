"""Building the planning snapshot from the database and the telemetry cache."""

from __future__ import annotations

import uuid

import pytest

from inventory import telemetry
from inventory.allocation import allocate
from inventory.models import Node
from inventory.nodes import change_state
from placement import snapshot_db
from placement.models import Deployment, EngineProfile, Hold, PowerBudget, Replica, Shard
from placement.planner import ReplicaRequest, plan
from placement.reconciler import reconcile
from tests.factories import gpu_payload, make_node

pytestmark = pytest.mark.django_db

SM_A = "0x0002c90300000001"
SM_B = "0x0002c90300000002"


def ib_port(hca: str, sm: str, sms=()) -> dict:
    return {"hca": hca, "port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand", "sm_guid": sm, "sms": sms}


def fabric_node(node_id, now, *, hcas=("mlx5_0", "mlx5_1"), **kw):
    return make_node(node_id, now=now, fabrics=[{"name": "ib0", "hcas": list(hcas), "rate_gbps": 400}], **kw)


def test_builds_nodes_with_claims_fabrics_and_holds(now):
    fabric_node(
        "a",
        now,
        labels={"rack": "r1"},
        weights=[{"path": "/models/x"}],
        storage=[
            {"path": "/data", "free_bytes": 5 * 10**12, "total_bytes": 8 * 10**12},
            {"path": "/filer", "free_bytes": 10**15, "total_bytes": 10**15, "shared": True},
        ],
    )
    make_node("b", now=now, gpus=[gpu_payload(0), gpu_payload(1, ecc_errors=3)])
    change_state("b", "cordoned", now=now)
    allocate(
        node_id="a",
        replica_id=uuid.uuid4(),
        shard_id=uuid.uuid4(),
        gpu_indices=[0, 1],
        memory_gb=100,
        cpu_cores=4,
        power_w=1500.0,
    )
    telemetry.put(
        "a",
        {
            "ib_ports": [ib_port("mlx5_0", SM_A, [{"guid": SM_A}, {"guid": SM_B}]), ib_port("mlx5_1", SM_B)],
            "gpus": [{"index": 0, "power_w": 300.0, "power_limit_w": 650.0}],
            "load": {"cpu_power_w": 200.0},
        },
    )
    Hold.objects.create(scope="label", label_key="rack", label_value="r9")
    PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=40_000)

    snap = snapshot_db.build()
    a, b = snap.nodes["a"], snap.nodes["b"]
    assert a.free == frozenset(range(2, 8))
    assert (a.memory_total_gb, a.memory_claimed_gb, a.cpu_count, a.cpu_claimed) == (1953, 100, 224, 4)
    assert (a.disk_free_bytes, a.disk_known) == (5 * 10**12, True)
    assert a.weights == frozenset({"/models/x"})
    # Two SMs listed together are one fabric, named by the lowest GUID: consistent through a failover.
    assert [(f.name, f.key, f.known, f.consistent) for f in a.fabrics] == [("ib0", f"sm:{SM_A}", True, True)]
    assert a.gpus[0].power_limit_w == 650.0 and a.power_draw_w == 500.0
    assert snap.budget_used == {("rack", "r1"): 1500.0}
    assert (b.state, b.free, b.weights, b.disk_known) == ("cordoned", frozenset({0}), None, False)
    assert b.fabrics == ()


def test_holds_keep_new_work_off(now):
    make_node("a", now=now, labels={"rack": "r12"})
    node_b = make_node("b", now=now)
    fabric_node("c", now)
    telemetry.put("c", {"ib_ports": [ib_port("mlx5_0", SM_A), ib_port("mlx5_1", SM_A)]})
    Hold.objects.create(scope="label", label_key="rack", label_value="r12")
    Hold.objects.create(scope="node", node=node_b)
    Hold.objects.create(scope="fabric", fabric="ib0")
    result = plan(ReplicaRequest(gpus_per_node=1), snapshot_db.build())
    assert result.reasons == {"a": "held: rack=r12", "b": "held: node", "c": "held: fabric ib0"}


def test_inconsistent_fabric_from_telemetry(now):
    fabric_node("a", now)
    telemetry.put("a", {"ib_ports": [ib_port("mlx5_0", SM_A), ib_port("mlx5_1", SM_B)]})
    f = snapshot_db.build().nodes["a"].fabrics[0]
    assert (f.consistent, f.keys) == (False, (f"sm:{SM_A}", f"sm:{SM_B}"))


def test_query_count_does_not_grow_with_nodes(now, django_assert_num_queries):
    for i in range(3):
        fabric_node(f"n{i}", now, weights=[{"path": "/m"}], storage=[{"path": "/d", "free_bytes": 1, "total_bytes": 2}])
    with django_assert_num_queries(11):
        snapshot_db.build()
    for i in range(3, 9):
        fabric_node(f"n{i}", now)
    with django_assert_num_queries(11):
        snapshot_db.build()


def test_two_node_replica_over_one_physical_fabric_end_to_end(now):
    for n in ("a", "b"):
        fabric_node(n, now, mgmt_addr=f"10.0.0.{ord(n)}")
        telemetry.put(n, {"ib_ports": [ib_port("mlx5_0", SM_A), ib_port("mlx5_1", SM_A)]})
    make_node("c", now=now)  # no fabric: never part of it
    prof = EngineProfile.objects.create(name="tp16", engine="echo", tp=16, nodes=2)
    Deployment.objects.create(name="big", served_model="big", profile=prof, replicas=1)
    reconcile(now=now)
    rep = Replica.objects.get()
    assert (rep.state, rep.fabric, rep.fabric_name) == ("starting", f"sm:{SM_A}", "ib0")
    # The endpoint is rank 0's: its node's address and HTTP port.
    assert rep.endpoint == "http://10.0.0.97:18000"
    shards = list(Shard.objects.order_by("rank").values_list("node_id", "rank", "gpu_indices", "hcas"))
    assert shards == [
        ("a", 0, list(range(8)), ["mlx5_0", "mlx5_1"]),
        ("b", 1, list(range(8)), ["mlx5_0", "mlx5_1"]),
    ]
    from inventory.models import Command

    p = Command.objects.get(node_id="b").payload
    assert (p["leader_addr"], p["leader_port"], p["nnodes"], p["fabric"]) == ("10.0.0.97", 18001, 2, "ib0")
    # Only the adapters of the replica's own fabric travel to the agent.
    assert p["hcas"] == ["mlx5_0", "mlx5_1"]


def test_every_port_a_shard_binds_is_stored_and_reserved_after_a_reload(now):
    for n in ("a", "b"):
        fabric_node(n, now, mgmt_addr=f"10.0.0.{ord(n)}", gpus=16, labels={"name": n})
        telemetry.put(n, {"ib_ports": [ib_port("mlx5_0", SM_A), ib_port("mlx5_1", SM_A)]})
    prof = EngineProfile.objects.create(name="tp16", engine="echo", tp=16, nodes=2, gpus_per_node=8)
    Deployment.objects.create(name="big", served_model="big", profile=prof, replicas=1)
    reconcile(now=now)
    leader = Shard.objects.get(rank=0)
    # The rendezvous port is the leader shard's, in the database: an index rebuilt from it
    # (a worker restarted, the kept index reloaded) cannot hand it to the next shard.
    assert (leader.node_id, leader.http_port, leader.rendezvous_port) == ("a", 18000, 18001)
    assert {18000, 18001} <= snapshot_db.build().nodes["a"].ports

    # SGLang with data-parallel attention binds 5 + dp ports after its HTTP port: all reserved.
    dp = EngineProfile.objects.create(
        name="dp", engine="sglang", tp=2, gpus_per_node=2, args=["--enable-dp-attention", "--dp-size", "2"]
    )
    Deployment.objects.create(name="dp", served_model="dp", profile=dp, replicas=1, node_selector={"name": "a"})
    reconcile(now=now)
    s = Shard.objects.get(replica__deployment__name="dp")
    assert (s.http_port, s.ports_after, s.rendezvous_port) == (18002, 7, None)
    one = EngineProfile.objects.create(name="one", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="one", served_model="one", profile=one, replicas=1, node_selector={"name": "a"})
    reconcile(now=now)
    assert Shard.objects.get(replica__deployment__name="one").http_port == 18010


JOINED = {
    "state": "Completed",
    "status": "Success",
    "cluster_uuid": "c0ffee00-0000-0000-0000-000000000001",
    "clique_id": "7",
}


def test_nvlink_domain_replica_gets_mnnvl(now):
    for n in ("a", "b"):
        make_node(
            n, now=now, gpus=[gpu_payload(i, fabric=JOINED) for i in range(4)], imex={"state": "UP", "channels": 1}
        )
    prof = EngineProfile.objects.create(name="nvl", engine="echo", gpus_per_node=4, nodes=2)
    Deployment.objects.create(name="nvl", served_model="nvl", profile=prof, replicas=1)
    reconcile(now=now)
    rep = Replica.objects.get()
    assert rep.nvlink_domain == "c0ffee00-0000-0000-0000-000000000001/7"
    from inventory.models import Command

    payloads = [c.payload for c in Command.objects.order_by("node_id")]
    assert [p["profile"]["env"] for p in payloads] == [{"NCCL_MNNVL_ENABLE": "1"}] * 2
    assert [p["nvlink_domain"] for p in payloads] == ["c0ffee00-0000-0000-0000-000000000001/7"] * 2


def test_a_domain_whose_imex_is_down_takes_no_multi_node_replica(now):
    for n in ("a", "b"):
        make_node(
            n, now=now, gpus=[gpu_payload(i, fabric=JOINED) for i in range(4)], imex={"state": "DOWN", "channels": 0}
        )
    snap = snapshot_db.build()
    assert (snap.nodes["a"].nvlink_domain, snap.nodes["a"].imex_up) == ("c0ffee00-0000-0000-0000-000000000001/7", False)
    result = plan(ReplicaRequest(gpus_per_node=4, nodes=2), snap)
    assert result.reasons["a"] == (
        "NVLink domain c0ffee00-0000-0000-0000-000000000001/7: IMEX down; "
        "no fabric: never hosts a multi-node replica; needs 2"
    )


def test_nodes_sharing_a_management_address_get_distinct_ports_without_any_setting(now, settings):
    # `make demo`: every simulated node registers from 127.0.0.1 and nothing sets LLMGW_SHARD_PORTS_UNIQUE.
    assert settings.LLMGW_SHARD_PORTS_UNIQUE is False
    for n in ("a", "b", "c"):
        make_node(n, now=now, mgmt_addr="127.0.0.1")
    make_node("d", now=now, mgmt_addr="10.0.0.4")
    prof = EngineProfile.objects.create(name="full", engine="echo", gpus_per_node=8)
    Deployment.objects.create(name="d", served_model="d", profile=prof, replicas=4)
    reconcile(now=now)
    # One port space at 127.0.0.1; another address is another host, counting from the base.
    assert sorted(Shard.objects.values_list("node_id", "http_port")) == [
        ("a", 18000),
        ("b", 18001),
        ("c", 18002),
        ("d", 18000),
    ]
    assert snapshot_db.build().host_ports == {"127.0.0.1": {18000, 18001, 18002}, "10.0.0.4": {18000}}


def test_ports_unique_across_the_cluster_for_a_fleet_on_one_host(now, settings):
    settings.LLMGW_SHARD_PORTS_UNIQUE = True
    make_node("a", now=now)
    make_node("b", now=now)
    prof = EngineProfile.objects.create(name="full", engine="echo", gpus_per_node=8)
    Deployment.objects.create(name="d", served_model="d", profile=prof, replicas=2)
    reconcile(now=now)
    assert sorted(Shard.objects.values_list("node_id", "http_port")) == [("a", 18000), ("b", 18001)]
    snap = snapshot_db.build()
    assert snap.cluster_ports == {18000, 18001}
    assert snapshot_db.build(unique_ports=False).cluster_ports is None


def test_failed_or_unsupported_engine_installs_block_the_engine(now):
    make_node(
        "a",
        now=now,
        engines_probed=True,
        engine_versions={"llamacpp": "b4000"},
        engine_installs=[
            {"engine": "vllm", "version": "0.8.5", "state": "failed", "detail": "no wheel for aarch64"},
            {"engine": "sglang", "version": "0.4.6", "state": "unsupported"},
            {"engine": "trtllm", "version": "0.19", "state": "installing"},
            {"engine": "tgi", "version": "3.2", "state": "ready"},
        ],
    )
    a = snapshot_db.build().nodes["a"]
    assert dict(a.engines_blocked) == {
        "vllm": "engine vllm failed: no wheel for aarch64",
        "sglang": "engine sglang unsupported",
    }
    assert a.engines == frozenset({"llamacpp", "tgi"})
    assert plan(ReplicaRequest(engine="vllm"), snapshot_db.build()).reasons == {
        "a": "engine vllm failed: no wheel for aarch64"
    }


def test_a_node_with_only_shared_storage_has_unknown_local_disk(now):
    make_node("a", now=now, storage=[{"path": "/filer", "free_bytes": 10**15, "total_bytes": 10**15, "shared": True}])
    snap = snapshot_db.build()
    assert (snap.nodes["a"].disk_free_bytes, snap.nodes["a"].disk_known) == (0, False)
    assert plan(ReplicaRequest(model_path="org/model", disk_gb=140), snap).node_ids == ["a"]


def test_a_local_filesystem_reporting_zero_bytes_is_unknown_local_disk(now):
    make_node("a", now=now, storage=[{"path": "/data", "free_bytes": 0, "total_bytes": 0}])
    snap = snapshot_db.build()
    assert (snap.nodes["a"].disk_free_bytes, snap.nodes["a"].disk_known) == (0, False)
    assert plan(ReplicaRequest(model_path="org/model", disk_gb=140), snap).node_ids == ["a"]


def test_a_node_that_looked_for_weights_and_found_none_is_excluded_from_a_local_path(now):
    make_node("looked-empty", now=now, gpus=1, weights=[])
    make_node("never-looked", now=now, gpus=1)
    snap = snapshot_db.build()
    assert (snap.nodes["looked-empty"].weights, snap.nodes["never-looked"].weights) == (frozenset(), None)
    assert plan(ReplicaRequest(model_path="/models/llama-70b"), snap).node_ids == ["never-looked"]
    # With the node that never looked out of the way, the one that looked is refused, saying why.
    change_state("never-looked", "cordoned", now=now)
    refused = plan(ReplicaRequest(model_path="/models/llama-70b"), snapshot_db.build())
    assert refused.reasons["looked-empty"] == "weights /models/llama-70b not present"


def test_a_tray_with_an_unhealthy_card_takes_no_multi_node_nvlink_replica_and_says_why(now):
    for n in ("a", "b"):
        cards = [gpu_payload(i, fabric=JOINED) for i in range(4)]
        if n == "b":
            cards[2]["fabric"] = {**JOINED, "health": "Unhealthy"}
        make_node(n, now=now, gpus=cards, imex={"state": "UP", "channels": 1})
    snap = snapshot_db.build()
    assert (snap.nodes["a"].nvlink_domain, snap.nodes["b"].nvlink_domain) == (
        "c0ffee00-0000-0000-0000-000000000001/7",
        "",
    )
    result = plan(ReplicaRequest(gpus_per_node=4, nodes=2), snap)
    assert result.reasons["b"] == (
        "out of NVLink: GPU 2 fabric health Unhealthy; no fabric: never hosts a multi-node replica; needs 2"
    )


def test_a_ready_node_never_heard_from_is_refused_not_a_crash(now):
    # A node row without a heartbeat (made by hand, or before its first one) has no lease at all.
    make_node("quiet", now=now)
    make_node("heard", now=now)
    Node.objects.filter(id="quiet").update(last_seen=None)
    snap = snapshot_db.build(now=now)
    assert (snap.nodes["quiet"].silent_s, snap.nodes["quiet"].schedulable) == (10**9, False)
    assert (snap.nodes["heard"].silent_s, snap.nodes["heard"].schedulable) == (0, True)
    assert plan(ReplicaRequest(gpus_per_node=1), snap, explain=True).reasons["quiet"] == "never heard from"
