"""What the doctor reads of telemetry: a heartbeat marks the feed when that changed, and only then."""

from __future__ import annotations

import pytest

from inventory import changes, doctor_view
from tests.inventory.ibports import SM_A, ib_port

pytestmark = pytest.mark.django_db

AT = 1_790_000_000.0


def entry(**kw) -> dict:
    e = {
        "at": AT,
        "agent_at": AT + 0.5,
        "ib_ports": [ib_port(counters={"symbol_error": 3, "port_xmit_data": 100}, tx_bps=1e9)],
        "gpus": [{"index": 0, "temp_c": 50.0, "power_w": 300.0, "power_limit_w": 700.0}],
    }
    e.update(kw)
    return e


def test_the_skew_finding_is_the_checks():
    assert doctor_view.skew({"at": AT, "agent_at": AT + 2.0}) is None
    assert doctor_view.skew({"at": AT, "agent_at": AT - 2.04}) == ("agent clock behind by 2.0 s", False)
    assert doctor_view.skew({"at": AT, "agent_at": AT + 31}) == ("agent clock ahead by 31.0 s", True)
    assert doctor_view.skew({"at": AT, "agent_at": None}) is None


def test_what_moves_every_heartbeat_is_not_the_doctors():
    before = entry()
    # The clocks move on, the skew stays within bounds; rates, data counters, heat and draw move.
    after = entry(
        at=AT + 5,
        agent_at=AT + 5.3,
        ib_ports=[ib_port(counters={"symbol_error": 3, "port_xmit_data": 900}, tx_bps=3e9)],
        gpus=[{"index": 0, "temp_c": 61.0, "power_w": 650.0, "power_limit_w": 700.0}],
    )
    assert doctor_view.view(before) == doctor_view.view(after)
    start = changes.current_version()
    assert not changes.mark_telemetry("a", before, after)
    assert changes.since(start).version == start


@pytest.mark.parametrize(
    "change",
    [
        {"agent_at": AT + 3.0},
        {"ib_ports": [ib_port(counters={"symbol_error": 4, "port_xmit_data": 100})]},
        {"ib_ports": [ib_port(counters={"symbol_error": 3}, rate_gbps=200)]},
        {"ib_ports": [ib_port(counters={"symbol_error": 3}, sm_guid="", sm_error="no SM")]},
        {"gpus": [{"index": 0, "wear": {"xid_errors": 1, "last_xid": 79}}]},
        {"gpus": [{"index": 0, "problems": ["fallen off the bus"]}]},
    ],
    ids=["skew", "error counter", "rate", "subnet manager", "wear", "problems"],
)
def test_what_the_doctor_reads_marks_the_node(change):
    before = entry()
    start = changes.current_version()
    assert changes.mark_telemetry("a", before, {**before, **change})
    assert changes.since(start).node_ids == frozenset({"a"})


def test_no_telemetry_and_an_empty_entry_read_alike():
    assert doctor_view.view(None) == doctor_view.view({}) == ()
    assert doctor_view.view({"ib_ports": [ib_port(sm_guid=SM_A)]}) != ()
