"""The planner: every constraint with its exact reason, and every tie-break. No database."""

from __future__ import annotations

import pytest

from placement.fit import choose_gpus
from placement.models import EngineProfile
from placement.planner import NoPlace, Plan, ReplicaRequest, plan, summarize
from placement.snapshot import FabricInfo, GPUInfo, HoldInfo, NodeInfo, Snapshot

H100 = "H100-80GB"


def gpus(count: int = 8, cls: str = H100, *, per_numa: int = 4, **kw) -> tuple[GPUInfo, ...]:
    return tuple(GPUInfo(index=i, gpu_class=cls, numa=i // per_numa, **kw) for i in range(count))


def node(node_id: str, count: int = 8, *, free: int | None = None, **kw) -> NodeInfo:
    g = kw.pop("gpus", None) or gpus(count)
    f = kw.pop("free_set", None)
    if f is None:
        f = frozenset(g_.index for g_ in g[: (count if free is None else free)])
    # Each node a host of its own: nodes at one address share their shard ports.
    kw.setdefault("mgmt_addr", f"{node_id}.nodes.example")
    return NodeInfo(id=node_id, gpus=g, free=frozenset(f), **kw)


def snap(*nodes: NodeInfo, **kw) -> Snapshot:
    return Snapshot(nodes={n.id: n for n in nodes}, **kw)


def req(**kw) -> ReplicaRequest:
    kw.setdefault("gpus_per_node", 4)
    return ReplicaRequest(**kw)


def only_reason(result, node_id: str) -> str:
    assert isinstance(result, NoPlace)
    return result.reasons[node_id]


# Per-node constraints, each with its reason -------------------------------------


@pytest.mark.parametrize("state", ["cordoned", "draining", "unreachable", "lost"])
def test_only_ready_nodes(state):
    assert only_reason(plan(req(), snap(node("a", state=state))), "a") == state


def test_free_gpus():
    assert only_reason(plan(req(), snap(node("a", free=3))), "a") == "3 free GPUs, needs 4"
    assert only_reason(plan(req(), snap(node("a", free=1))), "a") == "1 free GPU, needs 4"


def test_unhealthy_cards_are_not_counted_free_by_the_builder_but_free_set_rules():
    n = node("a", free_set={0, 1, 2, 4})
    assert plan(req(), snap(n)).shards[0].gpu_indices == (0, 1, 2, 4)


def test_held_node_label_and_fabric():
    s = snap(node("a", held="held: rack=r12"))
    assert only_reason(plan(req(), s), "a") == "held: rack=r12"
    h = HoldInfo(scope="fabric", fabric="ib0")
    assert h.matches("a", {}, [FabricInfo("ib0", ("mlx5_0",), key="sm:0x1", known=True)])
    assert HoldInfo(scope="label", label_key="rack", label_value="r12").text() == "held: rack=r12"


def test_label_selector():
    s = snap(node("a", labels={"pool": "b"}), node("b"))
    result = plan(req(selector={"pool": "a"}), s)
    assert result.reasons == {"a": "label pool=b, needs pool=a", "b": "no label pool, needs pool=a"}
    ok = plan(req(selector={"pool": "b"}), s)
    assert ok.node_ids == ["a"]


def test_gpu_class():
    s = snap(node("a", gpus=gpus(8, "A100-40GB")), node("b"))
    assert only_reason(plan(req(gpu_class=H100), snap(s.nodes["a"])), "a") == "no H100-80GB GPUs (has A100-40GB)"
    assert plan(req(gpu_class=H100), s).node_ids == ["b"]


def test_mixed_node_counts_only_cards_of_the_class():
    mixed = gpus(4, "A100-40GB") + tuple(GPUInfo(index=i, gpu_class=H100, numa=1) for i in range(4, 6))
    s = snap(node("a", gpus=mixed, free_set=set(range(6))))
    assert only_reason(plan(req(gpu_class=H100), s), "a") == "2 free GPUs, needs 4"
    assert plan(req(gpu_class=H100, gpus_per_node=2), s).shards[0].gpu_indices == (4, 5)


def test_host_memory_counts_what_is_claimed():
    s = snap(node("a", memory_total_gb=512, memory_claimed_gb=492))
    assert only_reason(plan(req(memory_gb=64), s), "a") == "needs 64 GB host memory, 20 free"


def test_memory_not_reported_constrains_nothing():
    assert plan(req(memory_gb=64), snap(node("a", memory_total_gb=0))).ok


def test_cpu_cores():
    s = snap(node("a", cpu_count=32, cpu_claimed=24))
    assert only_reason(plan(req(cpu_cores=16), s), "a") == "needs 16 CPU cores, 8 free"
    assert plan(req(cpu_cores=16), snap(node("b", cpu_count=0))).ok


def test_weights_at_a_local_path():
    s = snap(node("a", weights=frozenset({"/models/y"})), node("b", weights=None), node("c", weights={"/models/x"}))
    result = plan(req(model_path="/models/x"), snap(s.nodes["a"], s.nodes["b"]))
    assert result.node_ids == ["b"]  # did not look: constrains nothing
    assert only_reason(plan(req(model_path="/models/x"), snap(s.nodes["a"])), "a") == "weights /models/x not present"


def test_local_disk_for_weights_not_present():
    full = node("a", disk_known=True, disk_free_bytes=90 * 10**9)
    r = req(model_path="org/model", disk_gb=140)
    assert only_reason(plan(r, snap(full)), "a") == "needs 140 GB local disk for weights, 90 free"
    # Weights already there need no disk; unknown disk constrains nothing.
    have = node("a", disk_known=True, disk_free_bytes=0, weights=frozenset({"org/model"}))
    assert plan(r, snap(have)).ok
    assert plan(r, snap(node("a", disk_known=False))).ok


def test_engine_installed_or_installable():
    blocked = node("a", engines_probed=True, engines_blocked={"vllm": "engine vllm unsupported: no CUDA 12"})
    assert only_reason(plan(req(engine="vllm"), snap(blocked)), "a") == "engine vllm unsupported: no CUDA 12"
    installable = node("a", engines_probed=True)
    p = plan(req(engine="vllm"), snap(installable))
    assert p.shards[0].install_engine is True
    installed = node("a", engines_probed=True, engines=frozenset({"vllm"}))
    assert plan(req(engine="vllm"), snap(installed)).shards[0].install_engine is False
    unprobed = node("a", engines_probed=False)
    assert plan(req(engine="vllm"), snap(unprobed)).shards[0].install_engine is False


def test_power_budget_declared():
    n = node("a", labels={"rack": "r12"})
    s = snap(n, budgets={("rack", "r12"): 40_000.0}, budget_used={("rack", "r12"): 39_000.0})
    assert only_reason(plan(req(power_w=2200), s), "a") == "power budget rack=r12 would reach 41.2 of 40 kW"
    assert plan(req(power_w=1000), s).ok


def test_power_derived_from_cards_tdp_and_power_limit_and_cores():
    n = node("a", labels={"rack": "r1"})
    s = snap(n, budgets={("rack", "r1"): 3_000.0})
    # Four H100s at 700 W is 2.8 kW, 20 cores at 10 W more: 3.0 kW fits, one more core does not.
    assert plan(req(cpu_cores=20), s).shards[0].power_w == 3000.0
    assert only_reason(plan(req(cpu_cores=21), s), "a") == "power budget rack=r1 would reach 3 of 3 kW"
    limited = node("a", labels={"rack": "r1"}, gpus=gpus(8, power_limit_w=500.0))
    assert plan(req(), snap(limited, budgets={("rack", "r1"): 3_000.0})).shards[0].power_w == 2000.0


# Tie-breaks -------------------------------------------------------------------


def test_binpack_fills_the_fullest_node_first():
    s = snap(node("a", free=8), node("b", free=5), node("c", free=4), node("d", free=3))
    assert plan(req(), s, policy="binpack").node_ids == ["c"]


def test_spread_uses_the_emptiest_first():
    s = snap(node("a", free=5), node("b", free=8), node("c", free=4))
    assert plan(req(), s, policy="spread").node_ids == ["b"]


def test_equal_nodes_break_ties_by_id():
    s = snap(node("b"), node("a"), node("c"))
    assert plan(req(), s).node_ids == ["a"]
    assert plan(req(), s, policy="spread").node_ids == ["a"]


def test_nodes_at_one_address_share_their_shard_ports_in_a_pass():
    # A simulated fleet on one host: each node counting from the base collided.
    s = snap(node("a", mgmt_addr="127.0.0.1"), node("b", mgmt_addr="127.0.0.1"), node("c"))
    placed = []
    for _ in range(4):
        p = plan(req(gpus_per_node=8), s)
        if not isinstance(p, Plan):
            break
        s.reserve(p)
        placed.append((p.node_ids[0], p.shards[0].http_port))
    assert placed == [("a", 18000), ("b", 18001), ("c", 18000)]
    assert s.host_ports == {"127.0.0.1": {18000, 18001}, "c.nodes.example": {18000}}


def test_ports_already_used_at_an_address_count_for_every_node_there():
    s = snap(node("a", mgmt_addr="127.0.0.1", ports=frozenset({18000, 18002})), node("b", mgmt_addr="127.0.0.1"))
    assert s.free_port(s.nodes["b"]) == 18001
    assert s.free_port(s.nodes["b"], skip=[18001]) == 18003
    # Another address is another host: its ports are its own.
    assert snap(node("c", mgmt_addr="10.0.0.3")).free_port(node("c", mgmt_addr="10.0.0.3")) == 18000


def test_reserve_keeps_a_run_of_plans_consistent():
    s = snap(node("a"), node("b", free=4))
    placed = []
    for _ in range(3):
        p = plan(req(), s)
        assert isinstance(p, Plan)
        s.reserve(p)
        placed.append((p.node_ids[0], p.shards[0].gpu_indices, p.shards[0].http_port))
    assert placed == [("b", (0, 1, 2, 3), 18000), ("a", (0, 1, 2, 3), 18000), ("a", (4, 5, 6, 7), 18001)]
    assert plan(req(), s).reasons == {"a": "0 free GPUs, needs 4", "b": "0 free GPUs, needs 4"}


def test_reserve_counts_memory_and_power():
    s = snap(node("a", memory_total_gb=100, labels={"rack": "r"}), budgets={("rack", "r"): 5000.0}, budget_used={})
    p = plan(req(memory_gb=60, gpus_per_node=1, power_w=3000), s)
    s.reserve(p)
    assert s.budget_used == {("rack", "r"): 3000.0}
    assert only_reason(plan(req(memory_gb=60, gpus_per_node=1), s), "a") == "needs 60 GB host memory, 40 free"


def test_ports_skip_those_of_other_shards():
    s = snap(node("a", ports=frozenset({18000, 18002})))
    assert plan(req(), s).shards[0].http_port == 18001


def test_gpus_on_one_numa_node():
    # Free: 2, 3 on NUMA 0 and 4..7 on NUMA 1: four cards fit NUMA 1 alone.
    n = node("a", free_set={2, 3, 4, 5, 6, 7})
    assert choose_gpus(n, 4) == (4, 5, 6, 7)
    # Two cards: the NUMA node that fits exactly keeps the bigger one whole.
    assert choose_gpus(n, 2) == (2, 3)


def test_gpus_nvlink_peers_preferred():
    pairs = {0: {1}, 1: {0}, 2: {3}, 3: {2}}
    g = tuple(GPUInfo(index=i, gpu_class=H100, numa=0, nvlink_peers=frozenset(pairs[i])) for i in range(4))
    n = node("a", gpus=g, free_set={0, 2, 3})
    assert choose_gpus(n, 2) == (2, 3)


def test_gpus_nearest_the_fabric_hcas():
    g = tuple(
        GPUInfo(index=i, gpu_class=H100, numa=0, nic_paths={"mlx5_0": "PIX" if i >= 2 else "SYS"}) for i in range(4)
    )
    n = node("a", gpus=g, fabrics=(FabricInfo("ib0", ("mlx5_0",), key="sm:0x1", known=True),))
    assert choose_gpus(n, 2) == (2, 3)
    assert choose_gpus(n, 1, hcas=["mlx5_0"]) == (2,)


# Multi-node -------------------------------------------------------------------


def domain_node(node_id: str, domain: str = "cl-1/0", imex: bool = True, **kw) -> NodeInfo:
    return node(node_id, nvlink_domain=domain, imex_up=imex, **kw)


def ib(name: str = "ib0", key: str = "sm:0x0000000000000001", hcas=("mlx5_0", "mlx5_1"), **kw) -> FabricInfo:
    return FabricInfo(name, tuple(hcas), 400, key=key, known=True, consistent=True, keys=(key,), **kw)


def test_multi_node_inside_one_nvlink_domain_first():
    s = snap(
        domain_node("a", fabrics=(ib(),)),
        domain_node("b", fabrics=(ib(),)),
        domain_node("c", "cl-2/0"),
        node("d", fabrics=(ib(),)),
    )
    p = plan(req(nodes=2), s)
    assert p.node_ids == ["a", "b"]
    assert p.nvlink_domain == "cl-1/0"
    assert dict(p.env) == {"NCCL_MNNVL_ENABLE": "1"}
    assert [sh.rank for sh in p.shards] == [0, 1]
    assert p.shards[0].leader_port == 18001 and p.shards[1].leader_port == 0


def test_multi_node_needs_imex_up():
    s = snap(domain_node("a", imex=False), domain_node("b", imex=False))
    result = plan(req(nodes=2), s)
    assert result.reasons["a"] == (
        "NVLink domain cl-1/0: IMEX down; no fabric: never hosts a multi-node replica; needs 2"
    )


def test_multi_node_falls_back_to_one_physical_fabric_with_only_its_hcas():
    other = FabricInfo("eth0", ("mlx5_2",), 100, key="roce:10.0.0.0/24", known=True, consistent=True)
    s = snap(node("a", fabrics=(ib(), other)), node("b", fabrics=(ib(hcas=("mlx5_4",)),)))
    p = plan(req(nodes=2), s)
    assert p.fabric == "sm:0x0000000000000001"
    assert p.fabric_name == "ib0"
    assert p.env == {}
    assert [(sh.node_id, sh.hcas) for sh in p.shards] == [("a", ("mlx5_0", "mlx5_1")), ("b", ("mlx5_4",))]


def test_nodes_with_no_fabric_never_host_multi_node():
    result = plan(req(nodes=2), snap(node("a"), node("b")))
    assert result.reasons == {
        "a": "no fabric: never hosts a multi-node replica; needs 2",
        "b": "no fabric: never hosts a multi-node replica; needs 2",
    }


def test_fabric_cabled_to_two_physical_fabrics_is_avoided():
    bad = FabricInfo("ib0", ("mlx5_0", "mlx5_1"), key="", known=True, consistent=False, keys=("sm:0x1", "sm:0x2"))
    s = snap(node("a", fabrics=(bad,)), node("b", fabrics=(ib(),)), node("c", fabrics=(ib(),)))
    p = plan(req(nodes=2), s, explain=True)
    assert p.node_ids == ["b", "c"]
    assert p.reasons == {
        "a": "fabric ib0 cabled to two physical fabrics (sm:0x1, sm:0x2); needs 2",
    }
    assert isinstance(plan(req(nodes=2), snap(node("a", fabrics=(bad,)), node("b", fabrics=(ib(),)))), NoPlace)


def test_nodes_on_different_physical_fabrics_are_not_joined():
    s = snap(node("a", fabrics=(ib(key="sm:0x1"),)), node("b", fabrics=(ib(key="sm:0x2"),)))
    result = plan(req(nodes=2), s)
    assert result.reasons["a"] == "physical fabric sm:0x1 has 1 usable nodes; needs 2"


def test_multi_node_shards_count_together_against_a_budget():
    # Rack r1 has room for one 1.5 kW shard, not two: the second goes to another rack.
    s = snap(
        node("a", labels={"rack": "r1"}, fabrics=(ib(),)),
        node("b", labels={"rack": "r1"}, fabrics=(ib(),)),
        node("c", labels={"rack": "r2"}, fabrics=(ib(),)),
        budgets={("rack", "r1"): 40_000.0},
        budget_used={("rack", "r1"): 38_000.0},
    )
    assert plan(req(nodes=2, power_w=1500), s).node_ids == ["a", "c"]


def test_a_group_whose_shards_together_break_a_budget_says_so():
    s = snap(
        node("a", labels={"rack": "r1"}, fabrics=(ib(key="sm:0x1"),)),
        node("b", labels={"rack": "r1"}, fabrics=(ib(key="sm:0x1"),)),
        budgets={("rack", "r1"): 40_000.0},
        budget_used={("rack", "r1"): 38_000.0},
    )
    result = plan(req(nodes=2, power_w=1500), s)
    assert result.reasons["b"] == (
        "physical fabric sm:0x1 has 2 usable nodes, but not together (power budget rack=r1 would reach "
        "41 of 40 kW with the replica's other shards); needs 2"
    )


def test_multi_node_binpack_prefers_the_fuller_group():
    s = snap(
        node("a", fabrics=(ib(key="sm:0x1"),)),
        node("b", fabrics=(ib(key="sm:0x1"),)),
        node("c", free=4, fabrics=(ib(key="sm:0x2"),)),
        node("d", free=4, fabrics=(ib(key="sm:0x2"),)),
    )
    assert plan(req(nodes=2), s).node_ids == ["c", "d"]
    assert plan(req(nodes=2), s, policy="spread").node_ids == ["a", "b"]


def test_explain_says_a_group_that_could_have_taken_it_lost_to_the_policy():
    s = snap(
        node("a", fabrics=(ib(key="sm:0x1"),)),
        node("b", fabrics=(ib(key="sm:0x1"),)),
        node("c", free=4, fabrics=(ib(key="sm:0x2"),)),
        node("d", free=4, fabrics=(ib(key="sm:0x2"),)),
    )
    p = plan(req(nodes=2), s, explain=True)
    assert p.node_ids == ["c", "d"]
    assert p.reasons["a"] == "physical fabric sm:0x1 has 2 usable nodes; binpack chose c, d; needs 2"


def test_explain_gives_every_other_node_a_reason():
    s = snap(node("a"), node("b", free=4), node("c", state="cordoned"))
    p = plan(req(), s, explain=True)
    assert p.node_ids == ["b"]
    assert p.reasons == {"a": "fits; binpack chose b", "c": "cordoned"}


def test_summary_counts_reasons():
    reasons = {"a": "cordoned", "b": "cordoned", "c": "3 free GPUs, needs 4"}
    assert summarize(reasons) == "2 nodes: cordoned; 3 free GPUs, needs 4 (c)"
    assert plan(req(), snap()).reason == "no nodes"


def test_request_from_profile_derives_gpus_per_node():
    def profile(**kw) -> EngineProfile:  # unsaved: no database
        return EngineProfile(name="p", engine="vllm", tp=8, pp=2, nodes=2, **kw)

    assert ReplicaRequest.from_profile(profile()).gpus_per_node == 8
    assert ReplicaRequest.from_profile(profile(gpus_per_node=4)).gpus_per_node == 4


def test_fabrics_of_unknown_physical_fabric_are_not_joined():
    unknown = FabricInfo("ib0", ("mlx5_0",), key="", known=False)
    result = plan(req(nodes=2), snap(node("a", fabrics=(unknown,)), node("b", fabrics=(unknown,))))
    assert isinstance(result, NoPlace)
    assert result.reasons["a"] == "fabric ib0: no active adapter reports its physical fabric; needs 2"


def test_a_node_not_ready_is_not_a_candidate():
    s = snap(node("a", state="cordoned"), node("b", held="held: node"), node("c"))
    assert [n.id for n in s.candidates("", "", 1, spread=False)] == ["c"]
    assert [n.schedulable for n in s.nodes.values()] == [False, False, True]


def test_weights_presence_is_an_exact_path_not_a_prefix():
    result = plan(req(model_path="/models/llama-70b"), snap(node("a", weights=frozenset({"/models/llama"}))))
    assert only_reason(result, "a") == "weights /models/llama-70b not present"


def test_a_cpu_only_llamacpp_profile_needs_cores_and_no_gpu():
    # llama.cpp serves from cores alone: a profile with CPU cores and no GPUs per node asks for no card,
    # so a node without any can take it; vLLM's ranks each need a GPU whatever its cores.
    cpu = EngineProfile(name="cpu", engine="llamacpp", cpu_cores=30)
    assert ReplicaRequest.from_profile(cpu).gpus_per_node == 0
    assert ReplicaRequest.from_profile(EngineProfile(name="v", engine="vllm", cpu_cores=30)).gpus_per_node == 1
    assert (
        ReplicaRequest.from_profile(
            EngineProfile(name="g", engine="llamacpp", cpu_cores=8, gpus_per_node=1)
        ).gpus_per_node
        == 1
    )
    s = snap(node("cpu-a", 0, cpu_count=48), node("cpu-b", 0, cpu_count=16))
    p = plan(ReplicaRequest.from_profile(cpu), s, explain=True)
    assert (p.node_ids, p.shards[0].gpu_indices, p.shards[0].cpu_cores) == (["cpu-a"], (), 30)
    assert p.reasons == {"cpu-b": "needs 30 CPU cores, 16 free"}
