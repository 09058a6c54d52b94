"""What a heartbeat does to the inventory: lease, telemetry and rates, SM changes, fabrics, installs, IMEX."""

from __future__ import annotations

import datetime as dt

import pytest

import llmgw_wire as wire
from agents import protocol
from agents.credentials import NodeAuth
from inventory import changes, telemetry
from inventory import heartbeat as hb_rules
from inventory.models import GPU, EngineInstall, Node, NodeEvent, NodeState, SMChange
from inventory.nodes import change_state
from tests.agents.conftest import heartbeat_payload
from tests.factories import make_node

pytestmark = pytest.mark.django_db

CALLER = protocol.Caller(node=NodeAuth(node_id="node-a", used_previous=False, rotation_requested=False))


def beat(now: dt.datetime, **kw) -> wire.HeartbeatResponse:
    return protocol.heartbeat(CALLER, wire.Heartbeat.model_validate(heartbeat_payload(**kw)), now=now)


def test_rates_from_counter_deltas_zero_on_the_first(now):
    make_node("node-a", now=now)
    beat(now, at=100.0, counters=1_000)
    first = telemetry.get("node-a")
    assert [(p["tx_bps"], p["rx_bps"]) for p in first["ib_ports"]] == [(0.0, 0.0)] * 8
    assert first["gpus"][3]["temp_c"] == 57.0 and first["load"]["cpu_percent"] == 35.5
    beat(now + dt.timedelta(seconds=5), at=105.0, counters=1_000 + 1_250_000)
    # 1.25 M words of 4 bytes in 5 s = 1 MB/s = 8 Mb/s; rx counts twice as many.
    port = telemetry.get("node-a")["ib_ports"][0]
    assert (port["tx_bps"], port["rx_bps"]) == (8_000_000.0, 16_000_000.0)


def test_rates_use_server_time_without_agent_clock_and_ignore_counter_resets(now):
    make_node("node-a", now=now)
    beat(now, counters=5_000_000)
    beat(now + dt.timedelta(seconds=10), counters=6_000_000)
    assert telemetry.get("node-a")["ib_ports"][0]["tx_bps"] == 3_200_000.0
    beat(now + dt.timedelta(seconds=20), counters=10)
    assert telemetry.get("node-a")["ib_ports"][0]["tx_bps"] == 0.0


def test_master_sm_change_is_recorded_once(now):
    make_node("node-a", now=now)
    beat(now)
    assert SMChange.objects.count() == 0
    ports = heartbeat_payload()["ib_ports"]
    ports[2]["sm_guid"] = "0xA088C20300B3C4FF"
    beat(now + dt.timedelta(seconds=5), ib_ports=ports)
    beat(now + dt.timedelta(seconds=10), ib_ports=ports)
    change = SMChange.objects.get()
    assert (change.node_id, change.port, change.from_guid, change.to_guid) == (
        "node-a",
        "mlx5_2/1",
        "0xa088c20300b3c4d0",
        "0xa088c20300b3c4ff",
    )
    # A port losing its master is not a failover.
    ports[2]["sm_guid"] = ""
    beat(now + dt.timedelta(seconds=15), ib_ports=ports)
    assert SMChange.objects.count() == 1


def joined_fabric(cluster="c0ffee00-0000-0000-0000-000000000001", clique="3", state="Completed"):
    return {"state": state, "status": "Success", "cluster_uuid": cluster, "clique_id": clique, "bandwidth": "Full"}


def test_gpu_fabric_updates_recompute_the_nvlink_domain(now):
    make_node("node-a", now=now)
    assert Node.objects.get(id="node-a").nvlink_domain == ""
    fabrics = [{"index": i, "fabric": joined_fabric()} for i in range(8)]
    beat(now, gpu_fabrics=fabrics)
    assert Node.objects.get(id="node-a").nvlink_domain == "c0ffee00-0000-0000-0000-000000000001/3"
    assert GPU.objects.get(node_id="node-a", index=5).fabric_state == "Completed"
    # A fabric manager restart drops one card: the node leaves the domain.
    fabrics[5] = {"index": 5, "fabric": joined_fabric(state="In Progress")}
    beat(now + dt.timedelta(seconds=60), gpu_fabrics=fabrics)
    assert Node.objects.get(id="node-a").nvlink_domain == ""
    assert GPU.objects.get(node_id="node-a", index=5).fabric_state == "In Progress"
    assert NodeEvent.objects.filter(node_id="node-a", kind="nvlink").count() == 2


def test_a_fabric_report_marks_the_change_feed_only_when_it_changes_a_card(now):
    make_node("node-a", now=now)
    fabrics = [{"index": i, "fabric": joined_fabric()} for i in range(8)]
    version = changes.current_version()
    hb_rules.apply_gpu_fabrics("node-a", [wire.GPUFabricReport.model_validate(f) for f in fabrics],
                               current_domain="", now=now)  # fmt: skip
    assert changes.since(version).node_ids == frozenset({"node-a"})
    version = changes.current_version()
    # The same report again (the agent re-reads it every minute): nothing written, nothing marked.
    domain = Node.objects.get(id="node-a").nvlink_domain
    hb_rules.apply_gpu_fabrics("node-a", [wire.GPUFabricReport.model_validate(f) for f in fabrics],
                               current_domain=domain, now=now)  # fmt: skip
    assert changes.since(version).node_ids == frozenset()
    fabrics[2] = {"index": 2, "fabric": joined_fabric(state="In Progress")}
    hb_rules.apply_gpu_fabrics("node-a", [wire.GPUFabricReport.model_validate(f) for f in fabrics],
                               current_domain=domain, now=now)  # fmt: skip
    assert changes.since(version).node_ids == frozenset({"node-a"})


def test_a_card_turning_unhealthy_takes_the_node_out_of_its_domain(now):
    make_node("node-a", now=now)
    fabrics = [{"index": i, "fabric": {**joined_fabric(), "health": "Healthy"}} for i in range(8)]
    beat(now, gpu_fabrics=fabrics)
    assert Node.objects.get(id="node-a").nvlink_domain == "c0ffee00-0000-0000-0000-000000000001/3"
    fabrics[6] = {"index": 6, "fabric": {**joined_fabric(), "health": "Unhealthy"}}
    beat(now + dt.timedelta(seconds=60), gpu_fabrics=fabrics)
    assert Node.objects.get(id="node-a").nvlink_domain == ""
    assert GPU.objects.get(node_id="node-a", index=6).fabric_health == "Unhealthy"


def test_engine_installs_written_only_when_changed(now):
    make_node("node-a", now=now)
    installs = [{"engine": "vllm", "version": "0.11.0", "state": "installing"}]
    beat(now, engine_installs=installs)
    row = EngineInstall.objects.get(node_id="node-a")
    assert (row.engine, row.version, row.state) == ("vllm", "0.11.0", "installing")
    stamp = row.updated_at
    beat(now, engine_installs=installs)
    assert EngineInstall.objects.get(node_id="node-a").updated_at == stamp
    beat(now, engine_installs=[{"engine": "sglang", "state": "ready", "version": "0.5"}])
    assert list(EngineInstall.objects.filter(node_id="node-a").values_list("engine", "state")) == [("sglang", "ready")]


def test_imex_change_is_recorded(now):
    make_node("node-a", now=now)
    beat(now, imex={"state": "UP", "channels": 2048})
    node = Node.objects.get(id="node-a")
    assert (node.imex_state, node.imex_channels) == ("UP", 2048)
    beat(now, imex={"state": "UP", "channels": 2048})
    assert NodeEvent.objects.filter(node_id="node-a", kind="imex").count() == 1


@pytest.mark.parametrize("state", [NodeState.UNREACHABLE, NodeState.LOST])
def test_heartbeat_brings_a_silent_node_back(now, state):
    make_node("node-a", now=now)
    change_state("node-a", NodeState.UNREACHABLE, now=now)
    if state == NodeState.LOST:
        change_state("node-a", NodeState.LOST, now=now)
    Node.objects.filter(id="node-a").update(unreachable_since=now)
    later = now + dt.timedelta(minutes=10)
    beat(later)
    node = Node.objects.get(id="node-a")
    assert (node.state, node.last_seen, node.unreachable_since) == (NodeState.READY, later, None)
    assert (
        NodeEvent.objects.filter(node_id="node-a", kind="state").first().message
        == f"{state} -> ready: heartbeat resumed"
    )


def test_cordoned_node_stays_cordoned(now):
    make_node("node-a", now=now)
    change_state("node-a", NodeState.CORDONED, now=now)
    Node.objects.filter(id="node-a").update(unreachable_since=now)
    touched = hb_rules.touch("node-a", now=now)
    assert touched.state == NodeState.CORDONED
    assert Node.objects.get(id="node-a").unreachable_since is None


def test_touch_of_unknown_node_is_none(now):
    assert hb_rules.touch("nobody", now=now) is None


@pytest.mark.parametrize("silent_state", [NodeState.UNREACHABLE, NodeState.LOST])
def test_touch_brings_unreachable_and_lost_back_to_ready(now, silent_state):
    make_node("n1", now=now)
    Node.objects.filter(id="n1").update(state=silent_state, unreachable_since=now)
    later = now + dt.timedelta(minutes=10)
    assert hb_rules.touch("n1", now=later).state == NodeState.READY
    node = Node.objects.get(id="n1")
    assert (node.state, node.last_seen, node.unreachable_since) == (NodeState.READY, later, None)
    assert NodeEvent.objects.filter(node=node, kind="state").first().data == {
        "from": str(silent_state),
        "to": "ready",
        "reason": "heartbeat resumed",
    }


@pytest.mark.parametrize("operator_state", [NodeState.CORDONED, NodeState.DRAINING])
def test_touch_never_undoes_an_operator_state(now, operator_state):
    make_node("n1", now=now)
    change_state("n1", operator_state, now=now)
    assert hb_rules.touch("n1", now=now).state == operator_state


def test_a_port_gaining_a_master_is_not_a_failover(now):
    make_node("node-a", now=now)
    ports = heartbeat_payload()["ib_ports"]
    ports[2]["sm_guid"] = ""
    beat(now, ib_ports=ports)
    ports[2]["sm_guid"] = "0xA088C20300B3C4FF"
    beat(now + dt.timedelta(seconds=5), ib_ports=ports)
    assert SMChange.objects.count() == 0


def _synchronous_commit() -> str:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SHOW synchronous_commit")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_heartbeats_transaction_commits_asynchronously_and_only_it(now):
    from django.db import transaction

    make_node("node-a", now=now)
    with transaction.atomic():
        touched = hb_rules.touch("node-a", now=now + dt.timedelta(seconds=5), durable=False)
        assert _synchronous_commit() == "off"
    assert touched is not None and touched.state == NodeState.READY
    assert Node.objects.get(id="node-a").last_seen == now + dt.timedelta(seconds=5)
    # SET LOCAL: the setting ends with the transaction.
    assert _synchronous_commit() == "on"
    with transaction.atomic():
        hb_rules.touch("node-a", now=now, durable=True)
        assert _synchronous_commit() == "on"
