"""The doctor: each check passing and failing on a constructed inventory, the command and the API."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inventory import doctor, fabric, scans
from inventory.doctor import Result
from inventory.models import LivenessClock, Node
from inventory.nodes import change_state
from tests.factories import gpu_payload, make_node
from tests.inventory.ibports import SM_A, SM_OTHER, ib_port, put
from tests.inventory.test_scans import recorded

pytestmark = pytest.mark.django_db

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


# --- nodes ------------------------------------------------------------------


def test_nodes_reachable(now):
    make_node("a", now=now, gpus=0)
    make_node("b", now=now, gpus=0)
    make_node("c", now=now, gpus=0)
    assert_result(run(doctor.check_nodes_reachable, now), Result.PASS, [])
    change_state("b", "unreachable", now=now)
    r = run(doctor.check_nodes_reachable, now)
    assert_result(r, Result.WARN, ["b"], ["b: no heartbeat since 2026-11-30 12:00:00"])
    change_state("c", "unreachable", now=now)
    change_state("c", "lost", now=now)
    r = run(doctor.check_nodes_reachable, now)
    assert_result(r, Result.FAIL, ["b", "c"])
    assert r.details[1] == "c: lost: its replicas were declared dead"


def test_clock_skew(now):
    at = now.timestamp()
    for n in ("a", "b", "c"):
        make_node(n, now=now, gpus=0)
    put("a", now=now, agent_at=at + 1.5)
    put("b", now=now, agent_at=at + 1.0)
    assert_result(run(doctor.check_clock_skew, now), Result.PASS, [])
    put("b", now=now, agent_at=at - 5.0)
    assert_result(run(doctor.check_clock_skew, now), Result.WARN, ["b"], ["b: agent clock behind by 5.0 s"])
    put("c", now=now, agent_at=at + 45.0)
    assert_result(
        run(doctor.check_clock_skew, now),
        Result.FAIL,
        ["b", "c"],
        ["b: agent clock behind by 5.0 s", "c: agent clock ahead by 45.0 s"],
    )


# --- NVLink -----------------------------------------------------------------


def test_nvlink_joined(now):
    nvl_node("tray-1", now)
    # A lone HGX: a completed fabric with a cluster UUID of zeros is no domain, not a fault.
    zeros = {**JOINED, "cluster_uuid": "00000000-0000-0000-0000-000000000000"}
    make_node("hgx", now=now, gpus=[gpu_payload(i, fabric=zeros) for i in range(8)])
    make_node("pcie", now=now, gpus=2)
    assert_result(run(doctor.check_nvlink_joined, now), Result.PASS, [])
    nvl_node("tray-2", now, g2={"state": "In Progress", "status": "N/A", "cluster_uuid": ""})
    assert_result(
        run(doctor.check_nvlink_joined, now),
        Result.FAIL,
        ["tray-2"],
        ["tray-2: GPU 2 not joined (In Progress, N/A)"],
    )


def test_nvlink_bandwidth(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_bandwidth, now), Result.PASS, [])
    nvl_node("tray-2", now, g1={"bandwidth": "Degraded"})
    assert_result(
        run(doctor.check_nvlink_bandwidth, now),
        Result.WARN,
        ["tray-2"],
        ["tray-2: GPU 1 NVLink bandwidth Degraded"],
    )


def test_nvlink_health_unhealthy_card_keeps_the_node_out(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_health, now), Result.PASS, [])
    # The recorded GB200 card: joined (Completed, Success), full bandwidth, Summary Unhealthy.
    node = nvl_node("tray-2", now, g2={"health": "Unhealthy"})
    assert node.nvlink_domain == ""
    assert_result(
        run(doctor.check_nvlink_health, now),
        Result.FAIL,
        ["tray-2"],
        ["tray-2: GPU 2 NVLink fabric health Unhealthy: the node is kept out of multi-node NVLink placement"],
    )
    nvl_node("tray-3", now, g0={"health": "Healthy"})
    assert Node.objects.get(id="tray-3").nvlink_domain == f"{CLUSTER}/7"


def test_nvlink_domains(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_domains, now), Result.PASS, [])
    nvl_node("tray-2", now, g3={"clique_id": "8"})
    assert_result(
        run(doctor.check_nvlink_domains, now),
        Result.FAIL,
        ["tray-2"],
        [f"tray-2: cards in 2 domains: {CLUSTER}/7, {CLUSTER}/8"],
    )


def test_imex(now):
    nvl_node("tray-1", now)
    # Not in a domain: IMEX does not matter.
    make_node("pcie", now=now, gpus=2)
    assert_result(run(doctor.check_imex, now), Result.PASS, [])
    nvl_node("tray-2", now, imex={"state": "DOWN", "channels": 1})
    nvl_node("tray-3", now, imex={"state": "UP", "channels": 0})
    assert_result(
        run(doctor.check_imex, now),
        Result.FAIL,
        ["tray-2", "tray-3"],
        ["tray-2: IMEX DOWN", "tray-3: IMEX up without a channel"],
    )


# --- InfiniBand -------------------------------------------------------------


def test_ib_physical_fabric(now):
    make_node("a", now=now, gpus=0, fabrics=IB0)
    put("a", now=now, ports=[ib_port("mlx5_0"), ib_port("mlx5_1")])
    assert_result(run(doctor.check_ib_physical_fabric, now), Result.PASS, [])
    put("a", now=now, ports=[ib_port("mlx5_0"), ib_port("mlx5_1", sm_guid=SM_OTHER)])
    assert_result(
        run(doctor.check_ib_physical_fabric, now),
        Result.FAIL,
        ["a"],
        [f"a: fabric ib0: adapters on sm:{SM_A}, sm:{SM_OTHER}"],
    )


def test_ib_ports(now):
    make_node("a", now=now, gpus=0, fabrics=IB0)
    # mlx5_9 is not declared: its state is nobody's business.
    put("a", now=now, ports=[ib_port("mlx5_0"), ib_port("mlx5_1"), ib_port("mlx5_9", state="1: DOWN")])
    assert_result(run(doctor.check_ib_ports, now), Result.PASS, [])
    put("a", now=now, ports=[ib_port("mlx5_0", rate_gbps=200), ib_port("mlx5_1")])
    assert_result(
        run(doctor.check_ib_ports, now),
        Result.WARN,
        ["a"],
        ["a: mlx5_0/1 (ib0) at 200 Gb/s, declared 400 Gb/s"],
    )
    put("a", now=now, ports=[ib_port("mlx5_0", rate_gbps=200), ib_port("mlx5_1", state="2: INIT")])
    r = run(doctor.check_ib_ports, now)
    assert_result(r, Result.FAIL, ["a"], [r.details[0], "a: mlx5_1/1 (ib0) is 2: INIT"])


def test_ib_subnet_manager(now):
    make_node("a", now=now, gpus=0)
    make_node("b", now=now, gpus=0)
    put("a", now=now, ports=[ib_port()])
    # A RoCE port has no subnet manager to see.
    put("b", now=now, ports=[ib_port(link_layer="Ethernet", sm_guid="", network="10.0.0.0/24")])
    assert_result(run(doctor.check_ib_subnet_manager, now), Result.PASS, [])
    # An old failover is history, a recent one is news.
    fabric.record_sm_change(at=now - dt.timedelta(hours=2), node_id="a", port="mlx5_0/1", from_guid="x", to_guid="y")
    assert_result(run(doctor.check_ib_subnet_manager, now), Result.PASS, [])
    fabric.record_sm_change(
        at=now - dt.timedelta(minutes=5), node_id="a", port="mlx5_0/1", from_guid=SM_A, to_guid=SM_OTHER
    )
    assert_result(
        run(doctor.check_ib_subnet_manager, now),
        Result.WARN,
        ["a"],
        [f"a: mlx5_0/1 master SM {SM_A} -> {SM_OTHER} at 2026-11-30 11:55:00"],
    )
    put("a", now=now, ports=[ib_port(sm_guid="", sm_error="sminfo: query failed")])
    r = run(doctor.check_ib_subnet_manager, now)
    assert_result(r, Result.FAIL, ["a"])
    assert r.details[0] == "a: mlx5_0/1 sees no master SM: sminfo: query failed"


def test_ib_errors_rising_between_heartbeats(now):
    make_node("a", now=now, gpus=0)
    base = {"symbol_error": 10, "link_downed": 1, "port_rcv_errors": 0, "port_xmit_data": 1000}
    put("a", now=now, ports=[ib_port(counters=base)])
    # The first look only remembers: a year-old port's absolute counts say nothing.
    assert_result(run(doctor.check_ib_errors, now), Result.PASS, [])
    t1 = now + dt.timedelta(seconds=30)
    put("a", now=t1, ports=[ib_port(counters={**base, "port_xmit_data": 5000})])
    assert_result(run(doctor.check_ib_errors, t1), Result.PASS, [])
    t2 = now + dt.timedelta(seconds=60)
    put("a", now=t2, ports=[ib_port(counters={**base, "symbol_error": 25})])
    assert_result(run(doctor.check_ib_errors, t2), Result.WARN, ["a"], ["a: mlx5_0/1 symbol_error +15"])
    # Seen again by another caller moments later: still reported (the baseline did not move).
    assert_result(run(doctor.check_ib_errors, t2), Result.WARN, ["a"])
    t3 = now + dt.timedelta(seconds=90)
    put("a", now=t3, ports=[ib_port(counters={**base, "symbol_error": 25, "link_downed": 2})])
    assert_result(
        run(doctor.check_ib_errors, t3),
        Result.FAIL,
        ["a"],
        ["a: mlx5_0/1 symbol_error +15", "a: mlx5_0/1 link_downed +1"],
    )


def test_ib_errors_clear_after_two_windows_and_ignore_resets(now):
    make_node("a", now=now, gpus=0)
    put("a", now=now, ports=[ib_port(counters={"symbol_error": 10})])
    run(doctor.check_ib_errors, now)
    t1 = now + doctor.COUNTER_WINDOW
    put("a", now=t1, ports=[ib_port(counters={"symbol_error": 12})])
    assert_result(run(doctor.check_ib_errors, t1), Result.WARN, ["a"])
    # The counter stopped rising: one window later the old baseline rolls off.
    t2 = t1 + doctor.COUNTER_WINDOW
    put("a", now=t2, ports=[ib_port(counters={"symbol_error": 12})])
    assert_result(run(doctor.check_ib_errors, t2), Result.PASS, [])
    # A counter reset (perfquery -x, a reboot) is not a rise.
    t3 = t2 + dt.timedelta(seconds=10)
    put("a", now=t3, ports=[ib_port(counters={"symbol_error": 0})])
    assert_result(run(doctor.check_ib_errors, t3), Result.PASS, [])


def test_ib_scan_coverage(now):
    make_node("a", now=now, gpus=0)
    make_node("b", now=now, gpus=0)
    # a's adapter is in the recorded map (sysfs spelling); b's is not.
    put("a", now=now, ports=[ib_port(port_guid="78e7:d103:0022:97fd", node_guid="78e7:d103:0022:97fc")])
    put("b", now=now, ports=[ib_port(port_guid="0xa088c20300ab0001")])
    # No scan yet: not "ok", a warning saying so and what to do.
    r = run(doctor.check_ib_scan_coverage, now)
    assert_result(r, Result.WARN, ["a", "b"], [f"sm:{SM_A}: never scanned (2 node(s): a, b)"])
    assert r.summary == "1 InfiniBand fabric(s) never scanned"
    assert "Celery beat" in r.action
    [order] = scans.schedule_fabric_scans(now=now)
    fabric.set_scan(
        key=order.key, at=now, node_id="a", port="mlx5_0/1", output=recorded("x5-qdr-2020.topo"), error="", took_s=2
    )
    assert_result(
        run(doctor.check_ib_scan_coverage, now),
        Result.WARN,
        ["b"],
        [f"b: mlx5_0/1 (0xa088c20300ab0001) absent from the scan of sm:{SM_A} taken 2026-11-30 12:00:00"],
    )
    # A failed scan keeps the last good map, so the check still has one to read.
    later = now + dt.timedelta(minutes=10)
    fabric.set_scan(key=order.key, at=later, node_id="a", port="mlx5_0/1", output="", error="timeout", took_s=120)
    r = run(doctor.check_ib_scan_coverage, later)
    assert_result(r, Result.WARN, ["b"])
    assert r.details[0].endswith("taken 2026-11-30 12:00:00")


def test_ib_scan_coverage_of_a_lone_ca_that_sees_only_itself(now):
    make_node("a", now=now, gpus=0)
    # The map lists the CA with its node GUID and no port GUID line.
    put("a", now=now, ports=[ib_port(port_guid="0002:c900:0001:7dfe", node_guid="0002:c900:0001:7dfd")])
    [order] = scans.schedule_fabric_scans(now=now)
    text = "\n".join(line for line in recorded("sharp-an-hdr-excerpt.topo").splitlines()[7:] if "S-0002" not in line)
    fabric.set_scan(key=order.key, at=now, node_id="a", port="mlx5_0/1", output=text, error="", took_s=1)
    assert_result(run(doctor.check_ib_scan_coverage, now), Result.PASS, [])


# --- GPUs, engines, replicas ------------------------------------------------


def test_gpu_health(now):
    make_node("a", now=now, gpus=2)
    wear_ok = {"remapped_rows_correctable": 3, "xid_errors": 0, "nvlink_crc_errors": 0}
    put("a", now=now, gpus=[{"index": 0, "wear": wear_ok}, {"index": 1}])
    assert_result(run(doctor.check_gpu_health, now), Result.PASS, [])
    put("a", now=now, gpus=[{"index": 0, "wear": {"remap_pending": True}}, {"index": 1}])
    assert_result(
        run(doctor.check_gpu_health, now),
        Result.WARN,
        ["a"],
        ["a: GPU 0: memory rows remapped, waiting for a reset"],
    )
    make_node("b", now=now, gpus=[gpu_payload(0, problems=["process 4242 (python) not started by llmgw"])])
    put("b", now=now, gpus=[{"index": 0, "wear": {"remap_failure": True}}])
    r = run(doctor.check_gpu_health, now)
    assert_result(r, Result.FAIL, ["a", "b"])
    assert r.details[1:] == [
        "b: GPU 0: process 4242 (python) not started by llmgw",
        "b: GPU 0: out of spare memory rows: replace the card",
    ]


def test_gpu_health_application_xid_points_at_the_engine_not_the_card(now):
    make_node("a", now=now, gpus=1)
    put("a", now=now, gpus=[{"index": 0, "wear": {"xid_errors": 1, "last_xid": 31, "last_xid_text": "page fault"}}])
    r = run(doctor.check_gpu_health, now)
    assert_result(
        r,
        Result.WARN,
        ["a"],
        [
            "a: GPU 0: XID 31 (page fault): application fault: look at the engine's process and its log; "
            "the card needs no reset"
        ],
    )
    assert "reset the card" not in r.action.replace("do not reset the card", "")
    assert "read the shard's log" in r.action
    # A hardware XID on another node: a failure, and the card advice joins.
    make_node("b", now=now, gpus=1)
    put(
        "b",
        now=now,
        gpus=[
            {
                "index": 0,
                "wear": {"xid_errors": 2, "last_xid": 79, "last_xid_text": "GPU has fallen off the bus"},
                "problems": ["XID 79: GPU has fallen off the bus: reboot the node"],
            }
        ],
    )
    r = run(doctor.check_gpu_health, now)
    assert_result(r, Result.FAIL, ["a", "b"])
    assert r.details[1] == (
        "b: GPU 0: XID 79 (GPU has fallen off the bus): hardware or driver fault: drain and reboot the node; "
        "replace the card if it recurs"
    )
    assert len(r.details) == 2
    assert r.action.startswith("drain the node and reset the card")


def test_engine_installs(now):
    ok = [{"engine": "vllm", "version": "0.9.2", "state": "ready"}]
    make_node("a", now=now, gpus=0, engine_installs=ok)
    assert_result(run(doctor.check_engine_installs, now), Result.PASS, [])
    bad = [{"engine": "sglang", "version": "0.4.9", "state": "failed", "detail": "No space left on device"}]
    make_node("b", now=now, gpus=0, engine_installs=bad)
    assert_result(
        run(doctor.check_engine_installs, now),
        Result.FAIL,
        ["b"],
        ["b: sglang 0.4.9 failed: No space left on device"],
    )


# --- all together: the command and the API ----------------------------------


def healthy_cluster(now):
    nvl_node("tray-1", now, fabrics=IB0)
    # Two adapter ports of the recorded QDR map, and that map as the fabric's last scan.
    put(
        "tray-1",
        now=now,
        ports=[ib_port("mlx5_0", port_guid="78e7:d103:0022:97fd"), ib_port("mlx5_1", port_guid="0x003048c749cd0001")],
    )
    [order] = scans.schedule_fabric_scans(now=now)
    fabric.set_scan(
        key=order.key,
        at=now,
        node_id="tray-1",
        port="mlx5_0/1",
        output=recorded("x5-qdr-2020.topo"),
        error="",
        took_s=2,
    )


def test_run_on_a_healthy_cluster_passes_every_check(now):
    healthy_cluster(now)
    results = doctor.run(now=now)
    assert [r.name for r in results] == list(doctor.check_names())
    assert {r.result for r in results} == {Result.PASS}
    assert doctor.overall(results) == Result.PASS


def test_command_exit_status_and_json(now):
    healthy_cluster(now)
    import io

    out = io.StringIO()
    call_command("doctor", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["result"] == "pass"
    assert [c["name"] for c in report["checks"]] == list(doctor.check_names())
    change_state("tray-1", "unreachable", now=now)
    change_state("tray-1", "lost", now=now)
    out = io.StringIO()
    with pytest.raises(CommandError) as exc:
        call_command("doctor", stdout=out)
    assert exc.value.returncode == 1
    assert str(exc.value) == "failed: nodes_reachable"
    assert "FAIL nodes_reachable: 1 node(s) not heartbeating" in out.getvalue()
    assert "ok   clock_skew: every agent's clock is within 2 s" in out.getvalue()


def test_api_auth_matrix(client, viewer, operator, django_user_model):
    url = "/api/v1/doctor"
    assert client.get(url).status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Bearer some-node-credential").status_code == 401
    nobody = django_user_model.objects.create_user("nobody", password="pw-nobody-1")
    client.force_login(nobody)
    assert client.get(url).status_code == 403
    for user in (viewer, operator):
        client.force_login(user)
        resp = client.get(url)
        assert resp.status_code == 200
        body = resp.json()
        assert body["result"] == "pass"
        assert [c["name"] for c in body["checks"]] == list(doctor.check_names())
    assert client.post(url).status_code == 405


def test_api_reports_failures(client, viewer, now):
    make_node("a", now=now, gpus=0)
    change_state("a", "unreachable", now=now)
    client.force_login(viewer)
    body = client.get("/api/v1/doctor").json()
    assert body["result"] == "warn"
    check = next(c for c in body["checks"] if c["name"] == "nodes_reachable")
    assert check == {
        "name": "nodes_reachable",
        "result": "warn",
        "summary": "1 node(s) not heartbeating",
        "action": check["action"],
        "nodes": ["a"],
        "details": ["a: no heartbeat since 2026-11-30 12:00:00"],
    }


def test_control_plane_liveness_says_when_the_sweep_could_not_listen(now):
    """Mass silence fails the check, a recent blind window warns, a stalled sweep warns."""

    def check():
        return doctor.check_control_plane_liveness(doctor.load_inventory(now=now))

    assert check().result == doctor.Result.PASS
    LivenessClock.objects.create(
        last_sweep_at=now,
        disruption_since=now - dt.timedelta(seconds=40),
        disruption_detail="4 of 5 nodes silent at once",
    )
    got = check()
    assert got.result == doctor.Result.FAIL
    assert got.summary.startswith("4 of 5 nodes silent at once since ")
    assert "control plane's own outage" in got.summary
    LivenessClock.objects.update(
        disruption_since=None,
        blind_from=now - dt.timedelta(seconds=60),
        blind_until=now - dt.timedelta(seconds=20),
        blind_reason="no sweep for 40 s (database or beat down)",
    )
    got = check()
    assert got.result == doctor.Result.WARN
    assert "(no sweep for 40 s (database or beat down)); that silence was not held against any node" in got.summary
    LivenessClock.objects.update(blind_until=now - dt.timedelta(hours=2), last_sweep_at=now - dt.timedelta(seconds=60))
    got = check()
    assert got.result == doctor.Result.WARN
    assert got.summary == "no liveness sweep for 60 s: silent nodes are not being judged"
    LivenessClock.objects.update(last_sweep_at=now)
    assert check().result == doctor.Result.PASS
