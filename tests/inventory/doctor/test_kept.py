"""The kept doctor: a refresh re-checks only what changed, and its results equal a full run's over the same facts."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.cache import cache

import llmgw_wire as wire
from inventory import changes, doctor, fabric, liveness, telemetry
from inventory.doctor import Result
from inventory.doctor import kept as kept_doctor
from inventory.heartbeat import apply_engine_installs
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.doctor.helpers import IB0, nvl_node
from tests.inventory.ibports import SM_A, SM_B, ib_port, put
from tests.inventory.test_scans import recorded

pytestmark = pytest.mark.django_db

# Counters of a port that is fine, and of one whose cable is going.
CLEAN = {"symbol_error": 3, "link_downed": 0, "port_xmit_data": 10**9}
WEAR = {"xid_errors": 1, "last_xid": 79, "retired_pages_sbe": 0, "retired_pages_dbe": 0}


@pytest.fixture(autouse=True)
def _kept(settings):
    # Telemetry outlives these tests' clock: only the test of silence lets it lapse.
    settings.LLMGW_TELEMETRY_TTL = 7200.0
    kept_doctor.reset()
    yield
    kept_doctor.reset()


def heard(node_id: str, now: dt.datetime, **kw) -> None:
    """A heartbeat's telemetry, stored and marked as the heartbeat does (agents/protocol.py)."""
    previous = telemetry.get(node_id)
    changes.mark_telemetry(node_id, previous, put(node_id, now=now, **kw))


def ports(*, sm: str = SM_A, counters: dict | None = None, **overrides) -> list[dict]:
    return [
        ib_port(f"mlx5_{h}", sm_guid=sm, counters=counters or CLEAN, port_guid=f"0xa088c20300ab{h:04x}", **overrides)
        for h in range(2)
    ]


def fleet(now: dt.datetime) -> list[str]:
    """Nodes with something wrong of every kind the per-node checks find, and some with nothing wrong."""
    for n in ("ok-1", "ok-2", "ok-3", "ok-4", "counters", "skew", "wear"):
        nvl_node(n, now, fabrics=IB0)
    nvl_node("unjoined", now, fabrics=IB0, g1={"state": "In Progress", "status": "N/A"})
    nvl_node("degraded", now, fabrics=IB0, g2={"bandwidth": "Degraded"})
    nvl_node("split", now, fabrics=IB0, g3={"cluster_uuid": "c1a5e7e2-7c9b-4d1a-9f1e-00000000bbbb"})
    nvl_node("imex-down", now, fabrics=IB0, imex={"state": "DOWN", "channels": 0})
    make_node("slow", now=now, gpus=2, fabrics=IB0)
    make_node("no-sm", now=now, gpus=2, fabrics=IB0)
    names = [
        "ok-1", "ok-2", "ok-3", "ok-4", "counters", "skew", "wear", "unjoined", "degraded", "split", "imex-down",
    ]  # fmt: skip
    for n in names:
        heard(n, now, ports=ports())
    heard("skew", now, ports=ports(), agent_at=now.timestamp() + 5)
    heard("wear", now, ports=ports(), gpus=[{"index": 0, "temp_c": 50, "power_w": 300, "wear": WEAR}])
    heard("slow", now, ports=ports(rate_gbps=200))
    heard("no-sm", now, ports=ports(sm=""))
    return [*names, "slow", "no-sm"]


def both(now: dt.datetime) -> tuple[list[doctor.CheckResult], list[doctor.CheckResult]]:
    """The kept doctor's refresh, then a full run over the same facts at the same moment."""
    return kept_doctor.refresh(now=now), doctor.run(now=now)


def by_name(results: list[doctor.CheckResult]) -> dict[str, tuple[Result, list[str]]]:
    return {r.name: (r.result, r.nodes) for r in results}


def test_a_refresh_rechecks_only_what_changed_and_equals_a_full_run(now):
    fleet(now)
    change_state("degraded", "cordoned", now=now)
    first, full = both(now)
    assert first == full
    k = kept_doctor.kept()
    assert (k.full_runs, k.rechecked) == (1, 13)
    assert by_name(first) == {
        "control_plane_liveness": (Result.PASS, []),
        "nodes_reachable": (Result.PASS, []),
        "clock_skew": (Result.WARN, ["skew"]),
        "nvlink_joined": (Result.FAIL, ["unjoined"]),
        "nvlink_bandwidth": (Result.WARN, ["degraded"]),
        "nvlink_health": (Result.PASS, []),
        "nvlink_domains": (Result.FAIL, ["split"]),
        "imex": (Result.FAIL, ["imex-down"]),
        "ib_physical_fabric": (Result.PASS, []),
        "ib_ports": (Result.WARN, ["slow"]),
        "ib_subnet_manager": (Result.FAIL, ["no-sm"]),
        "ib_errors": (Result.PASS, []),
        "ib_scan_coverage": (Result.WARN, sorted(set(fleet_names()) - {"no-sm"})),
        "gpu_health": (Result.FAIL, ["wear"]),
        "engine_installs": (Result.PASS, []),
        "replicas_pending": (Result.PASS, []),
    }

    # A minute later, through the paths production writes by: heartbeats, a registration, the liveness
    # sweep's transition, an engine install's report, a failover, a scan.
    t1 = now + dt.timedelta(minutes=1)
    heard("counters", t1, ports=ports(counters={**CLEAN, "symbol_error": 9, "link_downed": 1}))
    heard("skew", t1, ports=ports(), agent_at=t1.timestamp())
    heard("ok-1", t1, ports=ports(state="1: DOWN"))
    # Only rates and data counters moved: not a change the doctor reads, and not re-checked.
    heard("ok-2", t1, ports=ports(counters={**CLEAN, "port_xmit_data": 10**10}))
    nvl_node("unjoined", t1, fabrics=IB0)
    nvl_node("new-1", t1, fabrics=IB0)
    heard("new-1", t1, ports=ports())
    change_state("ok-3", "unreachable", now=t1)
    # A silent cordoned node keeps its state and is flagged, with no mark on the feed: its row says so.
    liveness.flag_operator_node("degraded", "cordoned", now=t1, cutoff=t1)
    apply_engine_installs("ok-4", [wire.EngineInstall(engine="vllm", version="0.9", state="failed", detail="no disk")])
    fabric.record_sm_change(at=t1, node_id="ok-2", port="mlx5_0/1", from_guid=SM_B, to_guid=SM_A)
    topo = recorded("x5-qdr-2020.topo")
    fabric.set_scan(key=f"sm:{SM_A}", at=t1, node_id="ok-1", port="mlx5_0/1", output=topo, error="", took_s=2)
    second, full = both(t1)
    assert second == full
    # Re-checked: the nodes the feed or their rows named (ok-2's telemetry did not count, its scan
    # coverage did, being on the scanned fabric); no full run.
    assert (k.full_runs, k.last) == (
        1,
        {"counters", "skew", "ok-1", "unjoined", "new-1", "ok-3", "ok-4", "degraded"},
    )
    found = by_name(second)
    assert found["ib_errors"] == (Result.FAIL, ["counters"])
    assert found["clock_skew"] == (Result.PASS, [])
    assert found["ib_ports"] == (Result.FAIL, ["ok-1", "slow"])
    assert found["nvlink_joined"] == (Result.PASS, [])
    assert found["nodes_reachable"] == (Result.WARN, ["degraded", "ok-3"])
    assert found["engine_installs"] == (Result.FAIL, ["ok-4"])
    assert found["ib_subnet_manager"] == (Result.FAIL, ["no-sm", "ok-2"])
    # Every node on the scanned fabric is absent from the recorded map; ok-1's ports are down, off any fabric.
    assert found["ib_scan_coverage"][1] == sorted((set(fleet_names()) | {"new-1"}) - {"no-sm", "ok-1"})

    # Past a counter window nothing was marked, yet the baselines roll: the error-counter check alone
    # looks again, at the kept ports, and still matches a full run.
    t2 = now + doctor.COUNTER_WINDOW + dt.timedelta(seconds=5)
    third, full = both(t2)
    assert third == full
    assert k.last == set()
    assert by_name(third)["ib_errors"] == (Result.FAIL, ["counters"])
    # One more window with the counters still: the rise rolls off, with no heartbeat to say so.
    t3 = t2 + doctor.COUNTER_WINDOW
    fourth, full = both(t3)
    assert fourth == full
    assert by_name(fourth)["ib_errors"] == (Result.PASS, [])
    assert k.full_runs == 1


def fleet_names() -> list[str]:
    return [
        "ok-1", "ok-2", "ok-3", "ok-4", "counters", "skew", "wear", "unjoined", "degraded", "split", "imex-down",
        "slow", "no-sm",
    ]  # fmt: skip


def test_a_failover_that_renames_a_fabric_rechecks_every_node_on_the_shared_checks(now):
    make_node("a", now=now, gpus=0, fabrics=IB0)
    make_node("b", now=now, gpus=0, fabrics=IB0)
    heard("a", now, ports=ports(sm=SM_A))
    heard("b", now, ports=ports(sm=SM_B))
    first, full = both(now)
    assert first == full
    [coverage] = [r for r in first if r.name == "ib_scan_coverage"]
    assert coverage.details == [f"sm:{SM_A}: never scanned (1 node(s): a)", f"sm:{SM_B}: never scanned (1 node(s): b)"]
    # a's port lists both managers, b's master among them: one fabric, named after the lower GUID, on
    # b's findings too, though b itself sent nothing.
    sms = [{"guid": SM_A, "lid": 1, "priority": 15, "state": "master"}, {"guid": SM_B, "lid": 2, "state": "standby"}]
    heard("a", now, ports=ports(sm=SM_A, sms=sms))
    second, full = both(now)
    assert second == full
    assert kept_doctor.kept().last == {"a"}
    [coverage] = [r for r in second if r.name == "ib_scan_coverage"]
    assert coverage.details == [f"sm:{SM_A}: never scanned (2 node(s): a, b)"]


def test_a_gap_in_the_feed_is_a_full_run(now):
    fleet(now)
    both(now)
    cache.delete(changes.VERSION_KEY)
    change_state("ok-1", "unreachable", now=now)
    again, full = both(now)
    assert again == full
    assert kept_doctor.kept().full_runs == 2


def test_a_silent_node_whose_telemetry_expired_is_rechecked(now, settings):
    make_node("a", now=now, gpus=0, fabrics=IB0)
    heard("a", now, ports=ports(), agent_at=now.timestamp() + 40)
    first, _ = both(now)
    assert by_name(first)["clock_skew"] == (Result.FAIL, ["a"])
    # The telemetry's lifetime passed with no heartbeat: the cache dropped it, nothing was marked.
    settings.LLMGW_TELEMETRY_TTL = 120.0
    telemetry.forget("a")
    later = now + dt.timedelta(minutes=5)
    second, full = both(later)
    assert second == full
    assert by_name(second)["clock_skew"] == (Result.PASS, [])
    assert kept_doctor.kept().last == {"a"}
    # Gone from the telemetry: no longer watched for silence.
    both(later)
    assert kept_doctor.kept().last == set()


def test_a_deleted_node_leaves_the_results(now):
    fleet(now)
    both(now)
    from inventory.models import Node

    Node.objects.filter(id="split").delete()
    again, full = both(now)
    assert again == full
    assert by_name(again)["nvlink_domains"] == (Result.PASS, [])
