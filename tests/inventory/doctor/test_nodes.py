"""The doctor's node checks: reachability, clock skew, the control plane's own liveness."""

from __future__ import annotations

import datetime as dt

import pytest

from inventory import doctor
from inventory.doctor import Result
from inventory.models import LivenessClock
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.doctor.helpers import assert_result, run
from tests.inventory.ibports import put

pytestmark = pytest.mark.django_db


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
