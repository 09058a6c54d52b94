"""Operator actions on nodes: cordon, uncordon, drain, labels, forget."""

import datetime as dt
import uuid

import pytest

from inventory import liveness, operations, telemetry
from inventory.allocation import allocate
from inventory.heartbeat import touch
from inventory.models import Node, NodeEvent, NodeState
from inventory.nodes import TransitionError, change_state
from placement.models import Replica, Shard
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import put_telemetry, replica_on

pytestmark = pytest.mark.django_db


def test_cordon_records_who_and_when(now, operator):
    make_node("n1", now=now)
    assert operations.cordon("n1", now=now, actor=operator) == NodeState.CORDONED
    assert Node.objects.get(id="n1").state == "cordoned"
    ev = NodeEvent.objects.get(node_id="n1", kind="state")
    assert (ev.actor, ev.actor_name, ev.at) == (operator, "operator", now)
    assert ev.message == "ready -> cordoned: cordon by operator"


def test_uncordon_from_cordoned_and_draining(now):
    make_node("n1", now=now)
    make_node("n2", now=now)
    operations.cordon("n1", now=now)
    operations.drain("n2", now=now)
    operations.uncordon("n1", now=now)
    operations.uncordon("n2", now=now)
    assert list(Node.objects.values_list("state", flat=True)) == ["ready", "ready"]


def test_uncordon_refuses_an_unreachable_node(now):
    make_node("n1", now=now)
    change_state("n1", "unreachable", now=now)
    with pytest.raises(TransitionError, match="unreachable is not an operator's hold"):
        operations.uncordon("n1", now=now)


def test_cordon_then_uncordon_never_makes_a_silent_node_schedulable(now, settings):
    """unreachable -> cordoned was allowed, then cordoned -> ready: a dead node back in placement."""
    settings.LLMGW_UNREACHABLE_AFTER = 30
    make_node("n1", now=now)
    liveness.sweep(now=now)
    liveness.sweep(now=now + dt.timedelta(seconds=10))
    liveness.sweep(now=now + dt.timedelta(seconds=20))
    later = now + dt.timedelta(seconds=31)
    assert liveness.sweep(now=later).unreachable == ["n1"]
    assert operations.cordon("n1", now=later) == NodeState.CORDONED
    with pytest.raises(TransitionError, match=r"its agent has been silent since .*: it can be uncordoned once"):
        operations.uncordon("n1", now=later)
    # Nor by way of a drain.
    assert operations.drain("n1", now=later) == NodeState.DRAINING
    with pytest.raises(TransitionError, match="its agent has been silent since"):
        operations.uncordon("n1", now=later)
    assert Node.objects.get(id="n1").state == NodeState.DRAINING
    # Its heartbeats resume: now an uncordon is the operator's to give.
    touch("n1", now=later + dt.timedelta(seconds=1))
    assert operations.uncordon("n1", now=later + dt.timedelta(seconds=2)) == NodeState.READY


def test_uncordon_refuses_a_node_past_its_lease_before_any_sweep(now, settings):
    settings.LLMGW_UNREACHABLE_AFTER = 30
    make_node("n1", now=now)
    operations.cordon("n1", now=now)
    with pytest.raises(TransitionError, match="its agent has sent no heartbeat for 45 s"):
        operations.uncordon("n1", now=now + dt.timedelta(seconds=45))
    (verdict,) = operations.impact("uncordon", Node.objects.all(), now=now + dt.timedelta(seconds=45))
    assert not verdict.allowed
    assert operations.uncordon("n1", now=now + dt.timedelta(seconds=29)) == NodeState.READY


def test_uncordon_refusal_says_how_a_silent_node_comes_back(now):
    make_node("n1", now=now)
    change_state("n1", "unreachable", now=now)
    change_state("n1", "lost", now=now)
    with pytest.raises(TransitionError) as refused:
        operations.uncordon("n1", now=now)
    assert (
        str(refused.value) == "node n1: lost is not an operator's hold: it returns to ready when its heartbeats resume"
    )


def test_label_errors_name_the_key_and_the_rule():
    with pytest.raises(operations.LabelError) as key:
        operations.validate_labels({"-rack": "r1"})
    assert (key.value.field, key.value.message) == ("-rack", operations.KEY_RULE)
    assert "'_'" in operations.KEY_RULE  # the rule allows it, so the message says so
    with pytest.raises(operations.LabelError) as value:
        operations.validate_labels({"rack": "r 1"})
    assert (value.value.field, value.value.message) == ("rack", operations.VALUE_RULE)
    assert operations.validate_labels({"rack_row": "r_1"}) == {"rack_row": "r_1"}


def test_cordon_twice_is_refused_with_a_reason(now):
    make_node("n1", now=now)
    operations.cordon("n1", now=now)
    with pytest.raises(TransitionError, match="already cordoned"):
        operations.cordon("n1", now=now)


def test_drain_impact_lists_live_replicas_only(now):
    make_node("n1", now=now)
    live = replica_on("n1", now=now, deployment="llama", state="ready")
    replica_on("n1", now=now, deployment="qwen", state="stopped")
    replica_on("n1", now=now, deployment="mistral", state="failed")
    (verdict,) = operations.impact("drain", Node.objects.filter(id="n1"))
    assert verdict.allowed
    assert [(r.replica_id, r.deployment, r.shards) for r in verdict.replicas] == [
        (str(live.id), "llama", ("rank 0 (ready, GPUs 0,1)",))
    ]


def test_drain_progress_counts_down_to_empty(now):
    make_node("n1", now=now)
    replica = replica_on("n1", now=now)
    operations.drain("n1", now=now)
    progress = operations.drain_progress(Node.objects.get(id="n1"))
    assert progress.draining and not progress.done
    assert [r.replica_id for r in progress.remaining] == [str(replica.id)]
    replica.shards.update(state="stopped")
    assert operations.drain_progress(Node.objects.get(id="n1")).done


def test_validate_labels_names_the_bad_key():
    assert operations.validate_labels({"rack": "r12", "topology.example.com/zone": "a"}) == {
        "rack": "r12",
        "topology.example.com/zone": "a",
    }
    with pytest.raises(operations.LabelError) as err:
        operations.validate_labels({"rack": "r1", "bad key": "x"})
    assert err.value.field == "bad key"
    with pytest.raises(operations.LabelError) as err:
        operations.validate_labels({"rack": "x" * 64})
    assert err.value.field == "rack"
    with pytest.raises(operations.LabelError) as err:
        operations.validate_labels({"rack": "has space"})
    assert err.value.field == "rack"


def test_parse_label_lines():
    assert operations.parse_label_lines("rack = r1\n\n# comment\npool=batch\n") == {"rack": "r1", "pool": "batch"}
    with pytest.raises(operations.LabelError) as err:
        operations.parse_label_lines("rack=r1\nnonsense\n")
    assert err.value.field == "line 2"


def test_removing_an_operator_label_brings_the_agents_back(now, operator):
    make_node("n1", now=now, labels={"rack": "r1", "gpu": "h100"})
    assert operations.change_labels("n1", {"rack": "r9"}, now=now, actor=operator) == {"rack": "r9", "gpu": "h100"}
    assert operations.patch_labels("n1", {"rack": None, "pool": "batch"}, now=now, actor=operator) == {
        "rack": "r1",
        "gpu": "h100",
        "pool": "batch",
    }
    events = list(NodeEvent.objects.filter(node_id="n1", kind="labels").order_by("id"))
    assert [(e.actor_name, e.data["to"]) for e in events] == [
        ("operator", {"rack": "r9"}),
        ("operator", {"pool": "batch"}),
    ]


def test_forget_refused_while_holding_allocations_or_shards(now):
    make_node("n1", now=now)
    allocate(node_id="n1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0])
    replica_on("n1", now=now, state="ready")
    with pytest.raises(operations.ForgetRefused, match="n1 still holds 1 allocation and 1 shard not stopped"):
        operations.forget("n1", now=now)
    assert Node.objects.filter(id="n1").exists()


def test_forget_removes_node_and_telemetry(now):
    make_node("n1", now=now)
    put_telemetry("n1")
    operations.forget("n1", now=now)
    assert not Node.objects.filter(id="n1").exists()
    assert telemetry.get("n1") is None


def test_a_drained_node_whose_shards_all_ended_is_forgotten_with_its_history(now, operator):
    """Stopped and failed shards hold nothing: they do not block; the node's events stay, naming it."""
    make_node("n1", now=now)
    operations.drain("n1", now=now, actor=operator)
    stopped = replica_on("n1", now=now, state="stopped")
    failed = replica_on("n1", now=now, state="failed", gpus=(2,))
    assert operations.forget_refusal(Node.objects.get(id="n1")) == ""
    operations.forget("n1", now=now + dt.timedelta(minutes=1), actor=operator)
    assert not Node.objects.filter(id="n1").exists()
    assert not Shard.objects.exists()
    assert set(Replica.objects.values_list("id", flat=True)) == {stopped.id, failed.id}
    history = [(e.node_id, e.node_name, e.kind, e.actor_name) for e in NodeEvent.objects.order_by("at", "id")]
    assert history[-1] == (None, "n1", "forgotten", "operator")
    assert "state" in {kind for _, _, kind, _ in history[:-1]}
    assert all(node_id is None and name == "n1" for node_id, name, _, _ in history)


def test_label_lines_read_back_as_written():
    labels = {"rack": "r2", "pool": "batch", "empty": ""}
    assert operations.label_lines(labels) == "empty=\npool=batch\nrack=r2"
    assert operations.parse_label_lines(operations.label_lines(labels)) == labels
