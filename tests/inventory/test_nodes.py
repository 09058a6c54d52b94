"""Node lifecycle rules: re-registration, heartbeats, transitions, labels."""

import datetime as dt

import pytest

import llmgw_wire as wire
from inventory.models import GPU, FabricAttachment, Node, NodeEvent, NodeState
from inventory.nodes import TransitionError, change_state, set_operator_labels, upsert_node
from tests.factories import make_node, register_payload

pytestmark = pytest.mark.django_db


def reregister(node_id, now, **overrides):
    return upsert_node(wire.Register.model_validate(register_payload(node_id, **overrides)), now=now)


def test_registration_records_the_hardware(now):
    node = make_node(
        "gb200-01",
        now=now,
        gpus=2,
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400}],
        imex={"state": "UP", "channels": 1},
        host={"os_id": "ubuntu", "os_version": "24.04", "arch": "aarch64", "nvidia_driver": "570.124.06"},
    )
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert (node.os_id, node.os_version, node.arch, node.nvidia_driver) == ("ubuntu", "24.04", "aarch64", "570.124.06")
    assert (node.memory_total_mb, node.cpu_count, node.imex_state, node.imex_channels) == (2_000_000, 224, "UP", 1)
    assert list(node.gpus.values_list("index", "gpu_class")) == [(0, "H100-80GB"), (1, "H100-80GB")]
    fab = FabricAttachment.objects.get(node=node)
    assert (fab.name, fab.hcas, fab.rate_gbps) == ("ib-a", ["mlx5_0", "mlx5_1"], 400)
    assert NodeEvent.objects.filter(node=node, kind="registered").count() == 1


def test_missing_memory_and_cpus_mean_unknown_not_none(now):
    payload = register_payload("old-agent")
    del payload["memory_total_mb"], payload["cpu_count"]
    node, _ = upsert_node(wire.Register.model_validate(payload), now=now)
    assert (node.memory_total_mb, node.cpu_count) == (0, 0)
    assert (node.storage_reported, node.weights_reported) == (False, False)


@pytest.mark.parametrize("operator_state", [NodeState.CORDONED, NodeState.DRAINING])
def test_reregistration_keeps_cordon_and_drain(now, operator_state):
    make_node("n1", now=now)
    assert change_state("n1", operator_state, now=now, reason="maintenance")
    node, created = reregister("n1", now + dt.timedelta(seconds=5))
    assert created is False
    assert node.state == operator_state
    assert Node.objects.get(id="n1").state == operator_state


@pytest.mark.parametrize("silent_state", [NodeState.UNREACHABLE, NodeState.LOST])
def test_reregistration_brings_a_silent_node_back(now, silent_state):
    make_node("n1", now=now)
    Node.objects.filter(id="n1").update(state=silent_state)
    node, _ = reregister("n1", now)
    assert node.state == NodeState.READY


def test_only_ready_is_schedulable(now):
    make_node("n1", now=now)
    for state in NodeState:
        Node.objects.filter(id="n1").update(state=state)
        assert Node.objects.get(id="n1").schedulable is (state == NodeState.READY)


def test_change_state_refuses_invalid_moves(now):
    make_node("n1", now=now)
    with pytest.raises(TransitionError, match="cannot go from ready to lost"):
        change_state("n1", NodeState.LOST, now=now)
    assert Node.objects.get(id="n1").state == NodeState.READY


def test_change_state_is_a_compare_and_set(now):
    make_node("n1", now=now)
    # A sweep that read "ready" must not mark unreachable a node that an
    # operator cordoned in between.
    change_state("n1", NodeState.CORDONED, now=now)
    assert change_state("n1", NodeState.UNREACHABLE, now=now, expected=NodeState.READY) is False
    assert Node.objects.get(id="n1").state == NodeState.CORDONED


def test_change_state_records_who_and_why(now, operator):
    make_node("n1", now=now)
    change_state("n1", NodeState.CORDONED, now=now, actor=operator, reason="bad fan")
    ev = NodeEvent.objects.filter(node_id="n1", kind="state").get()
    assert (ev.actor, ev.actor_name, ev.message, ev.at) == (operator, "operator", "ready -> cordoned: bad fan", now)


def test_operator_labels_overlay_agent_labels_and_removal_restores_them(now):
    make_node("n1", now=now, labels={"rack": "r1", "zone": "a"})
    assert set_operator_labels("n1", {"rack": "r9", "team": "llm"}, now=now) == {
        "rack": "r9",
        "zone": "a",
        "team": "llm",
    }
    # The agent re-registers with its own labels: the operator's survive.
    node, _ = reregister("n1", now, labels={"rack": "r1", "zone": "b"})
    assert node.labels == {"rack": "r9", "zone": "b", "team": "llm"}
    assert node.agent_labels == {"rack": "r1", "zone": "b"}
    # Removing the operator's rack brings the agent's value back.
    assert set_operator_labels("n1", {"team": "llm"}, now=now) == {"rack": "r1", "zone": "b", "team": "llm"}
    assert Node.objects.get(id="n1").effective_labels() == {"rack": "r1", "zone": "b", "team": "llm"}


def test_reregistration_replaces_gpus_whole(now):
    make_node("n1", now=now, gpus=4)
    reregister("n1", now, gpus=1)
    assert list(GPU.objects.filter(node_id="n1").values_list("index", flat=True)) == [0]


def test_registration_with_duplicate_gpu_index_is_refused():
    with pytest.raises(ValueError, match="GPU index 0 appears twice"):
        wire.Register.model_validate(register_payload("n1") | {"gpus": [{"index": 0}, {"index": 0}]})


def test_engines_probed_tells_none_from_too_old(now):
    probed = make_node("probed", now=now, engine_versions={}, engines_probed=True)
    old = make_node("old", now=now, engine_versions={})
    assert (probed.engine_versions, probed.engines_probed) == ({}, True)
    assert (old.engine_versions, old.engines_probed) == ({}, False)


def test_registration_records_the_agents_features(now):
    node = make_node("n1", now=now, features=["adoption", "fabric-scan"])
    assert Node.objects.get(id="n1").features == ["adoption", "fabric-scan"]
    assert node.features == ["adoption", "fabric-scan"]
