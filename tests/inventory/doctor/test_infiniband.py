"""The doctor's InfiniBand checks: physical fabrics, ports, subnet managers, error counters, scan coverage."""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest
from django.core.cache import cache

from inventory import doctor, fabric, scans
from inventory.doctor import Result
from inventory.doctor.infiniband import baseline_phase
from inventory.doctor.loader import load_baselines
from tests.factories import make_node
from tests.inventory.doctor.helpers import IB0, assert_result, run
from tests.inventory.ibports import SM_A, SM_OTHER, ib_port, put
from tests.inventory.test_scans import recorded

pytestmark = pytest.mark.django_db


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


def test_a_fleet_first_seen_together_rolls_its_counter_baselines_spread_over_half_a_window(now):
    # Rolled all at once every window, the kept doctor re-checked the whole fleet's counters in one
    # refresh (1.1-1.9 s of the worker's CPU at 10,000 nodes).
    names = [f"n-{i:03d}" for i in range(120)]
    for n in names:
        make_node(n, now=now, gpus=0)
        put(n, now=now, ports=[ib_port(counters={"symbol_error": 1})])
    run(doctor.check_ib_errors, now)
    stored = load_baselines(names)
    window = doctor.COUNTER_WINDOW.total_seconds()
    ats = {n: stored[n]["cur"]["at"] for n in names}
    assert ats == {n: now.timestamp() - baseline_phase(n) for n in names}
    assert all(now.timestamp() - window / 2 < at <= now.timestamp() for at in ats.values())
    # Refreshes every 10 s: no more than a few nodes roll at any one of them, over most of the half window.
    slots = Counter(int((at + window - now.timestamp()) // 10) for at in ats.values())
    assert max(slots.values()) <= 8
    assert max(slots) - min(slots) >= 25
    # Each rolls once its own window is over, then every whole window after.
    a = names[0]
    due = dt.timedelta(seconds=window - baseline_phase(a))
    put(a, now=now + due, ports=[ib_port(counters={"symbol_error": 3})])
    assert_result(run(doctor.check_ib_errors, now + due - dt.timedelta(seconds=1)), Result.WARN, [a])
    assert load_baselines([a])[a]["cur"]["at"] == ats[a]
    assert_result(run(doctor.check_ib_errors, now + due), Result.WARN, [a])
    assert load_baselines([a])[a]["cur"]["at"] == (now + due).timestamp()
    assert load_baselines([a])[a]["prev"]["at"] == ats[a]


def test_a_counter_baseline_of_the_old_shape_starts_anew_with_its_phase(now):
    make_node("a", now=now, gpus=0)
    put("a", now=now, ports=[ib_port(counters={"symbol_error": 9})])
    old = {"prev": None, "cur": {"at": now.timestamp() - 30, "ports": {"mlx5_0/1": {"symbol_error": 1}}}}
    cache.set(doctor.counter_key("a"), old)
    # Not compared with the old shape's values (+8 would be a rise): one fresh baseline, dated back.
    assert_result(run(doctor.check_ib_errors, now), Result.PASS, [])
    assert load_baselines(["a"])["a"] == {
        "v": 2,
        "prev": None,
        "cur": {"at": now.timestamp() - baseline_phase("a"), "ports": {"mlx5_0/1": {"symbol_error": 9}}},
    }
