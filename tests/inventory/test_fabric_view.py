"""The fabrics page's data: physical fabrics from the cache, declarations, SMs, changes, scans."""

import datetime as dt

import pytest

from inventory import fabric_view
from inventory.fabric import record_sm_change, set_scan
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import ib_port, put_telemetry

pytestmark = pytest.mark.django_db

SM_A = "0x0000000000000a01"
SM_B = "0x0000000000000a02"
SM_C = "0x0000000000000c01"


@pytest.fixture
def cabled(now):
    # n1 and n2 on fabric A (n2 already sees the standby B as master after a failover),
    # n3 declares both its adapters as "ib" but one is cabled to fabric C.
    make_node("n1", now=now, gpus=0, fabrics=[{"name": "ib", "hcas": ["mlx5_0"]}])
    make_node("n2", now=now, gpus=0, fabrics=[{"name": "compute", "hcas": ["mlx5_0"]}])
    make_node("n3", now=now, gpus=0, fabrics=[{"name": "ib", "hcas": ["mlx5_0", "mlx5_1"]}])
    make_node("n4", now=now, gpus=0, fabrics=[{"name": "ib", "hcas": ["mlx5_0"]}])
    put_telemetry("n1", ports=[ib_port("mlx5_0", sm=SM_A, sms=[(SM_A, "MASTER"), (SM_B, "STANDBY")], tx=3e9, rx=1e9)])
    put_telemetry("n2", ports=[ib_port("mlx5_0", sm=SM_B)])
    put_telemetry("n3", ports=[ib_port("mlx5_0", sm=SM_A), ib_port("mlx5_1", sm=SM_C)])
    put_telemetry("n4", ports=[ib_port("mlx5_0", sm=SM_A, state="DOWN")])


def test_fabrics_grouped_by_canonical_sm(cabled, now):
    page = fabric_view.gather(now=now)
    assert [f.key for f in page.fabrics] == [f"sm:{SM_A}", f"sm:{SM_C}"]
    a, c = page.fabrics
    assert a.nodes == ["n1", "n2", "n3"]
    assert [(p.node_id, p.hca, p.sm_guid, p.tx_bps) for p in a.ports] == [
        ("n1", "mlx5_0", SM_A, 3e9),
        ("n2", "mlx5_0", SM_B, 0.0),
        ("n3", "mlx5_0", SM_A, 0.0),
    ]
    assert a.declared == ["compute", "ib"]
    assert [m.guid for m in a.masters] == [SM_A, SM_B]
    assert c.declared == [] and c.nodes == ["n3"]


def test_standby_listed_apart_from_master(now):
    make_node("n1", now=now, gpus=0)
    put_telemetry("n1", ports=[ib_port("mlx5_0", sm=SM_A, sms=[(SM_A, "MASTER"), (SM_B, "STANDBY")])])
    (f,) = fabric_view.gather(now=now).fabrics
    assert [(m.guid, m.master) for m in f.masters] == [(SM_A, True)]
    assert [(s.guid, s.state, s.master) for s in f.standbys] == [(SM_B, "STANDBY", False)]


def test_disagreement_and_unconfirmed(cabled, now):
    page = fabric_view.gather(now=now)
    (d,) = page.disagreements
    assert (d.node_id, d.name, d.hcas, d.keys) == ("n3", "ib", ["mlx5_0", "mlx5_1"], [f"sm:{SM_A}", f"sm:{SM_C}"])
    assert page.fabrics[0].disagreements == [d] and page.fabrics[1].disagreements == [d]
    assert page.unconfirmed == [("n4", "ib")]


def test_sm_changes_and_scan(cabled, now):
    record_sm_change(at=now - dt.timedelta(minutes=5), node_id="n2", port="mlx5_0/1", from_guid=SM_A, to_guid=SM_B)
    record_sm_change(at=now, node_id="n3", port="mlx5_1/1", from_guid="", to_guid=SM_C)
    set_scan(
        key=f"sm:{SM_A}",
        at=now - dt.timedelta(minutes=20),
        node_id="n1",
        port="mlx5_0/1",
        output="map",
        error="",
        took_s=1.5,
    )
    set_scan(
        key=f"sm:{SM_A}",
        at=now - dt.timedelta(minutes=10),
        node_id="n1",
        port="mlx5_0/1",
        output="",
        error="timeout",
        took_s=120,
    )
    a, c = fabric_view.gather(now=now).fabrics
    assert [(x.node_id, x.to_guid) for x in a.sm_changes] == [("n2", SM_B)]
    assert [(x.node_id, x.to_guid) for x in c.sm_changes] == [("n3", SM_C)]
    assert (a.scan.output, a.scan.error, a.scan_age_s) == ("map", "timeout", 600.0)
    assert c.scan is None


def test_roce_fabric_by_network(now):
    make_node("r1", now=now, gpus=0, fabrics=[{"name": "eth", "hcas": ["mlx5_0"]}])
    put_telemetry(
        "r1",
        ports=[{"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "network": "10.0.0.0/24"}],
    )
    (f,) = fabric_view.gather(now=now).fabrics
    assert (f.key, f.kind, f.declared) == ("roce:10.0.0.0/24", "roce", ["eth"])
