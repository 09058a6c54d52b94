"""The doctor's GPU checks: wear and health, engine installations."""

from __future__ import annotations

import pytest

from inventory import doctor
from inventory.doctor import Result
from tests.factories import gpu_payload, make_node
from tests.inventory.doctor.helpers import assert_result, run
from tests.inventory.ibports import put

pytestmark = pytest.mark.django_db


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
