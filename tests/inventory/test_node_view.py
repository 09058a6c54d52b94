"""The node page's tables: GPUs with live sensors, NVLink matrix, nearest adapters, ports, problems."""

import datetime as dt

import pytest

from inventory import node_view
from inventory.models import Node
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import card, ib_port, put_telemetry

pytestmark = pytest.mark.django_db


def test_nearest_adapters():
    assert node_view.nearest_adapters({"mlx5_0": "SYS", "mlx5_1": "PIX", "mlx5_2": "PIX"}) == ["mlx5_1", "mlx5_2"]
    assert node_view.nearest_adapters({"mlx5_0": "NODE", "mlx5_1": "SYS"}) == ["mlx5_0"]
    assert node_view.nearest_adapters({}) == []
    assert node_view.nearest_adapters({"mlx5_0": "NV4"}) == []


def test_nvlink_matrix(now):
    make_node("n", now=now, gpus=[card(i) for i in range(3)])
    gpus = list(Node.objects.get(id="n").gpus.order_by("index"))
    gpus[2].nvlink_peers = [0]
    assert node_view.nvlink_matrix(gpus) == [
        (0, ["X", "NV", "NV"]),
        (1, ["NV", "X", "NV"]),
        (2, ["NV", "", "X"]),
    ]


XID_79 = "XID 79 (fell off the bus): hardware or driver fault: drain and reboot the node; replace the card if it recurs"


def test_gpu_rows_join_sensors_and_wear(now):
    make_node("n", now=now, gpus=[card(0), card(1, joined=False)])
    put_telemetry(
        "n",
        gpus=[
            {"index": 0, "temp_c": 55, "power_w": 600, "power_limit_w": 1000, "util_percent": 40},
            {
                "index": 1,
                "util_percent": -1,
                "wear": {"xid_errors": 2, "last_xid": 79, "last_xid_text": "fell off the bus"},
            },
        ],
    )
    page = node_view.node_page(Node.objects.get(id="n"))
    r0, r1 = page.gpus
    assert (r0.temp_c, r0.power_w, r0.power_limit_w, r0.util_percent, r0.healthy) == (55, 600, 1000, 40, True)
    assert r0.nearest == ["mlx5_0"]
    assert (r1.util_percent, r1.temp_c, r1.wear) == (None, None, [XID_79])
    # A hardware XID in the wear column: never "healthy" beside it, even with no problem sent.
    assert r1.healthy is False
    assert r1.nearest == ["mlx5_0"]
    assert page.problems == [f"GPU 1: {XID_79}", "NVLink: 1 of 2 cards joined"]


def test_an_application_xid_leaves_the_card_healthy_and_points_at_the_engine(now):
    make_node("n", now=now, gpus=[card(0)])
    put_telemetry("n", gpus=[{"index": 0, "wear": {"xid_errors": 1, "last_xid": 31, "last_xid_text": "page fault"}}])
    [row] = node_view.node_page(Node.objects.get(id="n")).gpus
    assert row.healthy is True
    assert row.wear == [
        "XID 31 (page fault): application fault: look at the engine's process and its log; the card needs no reset"
    ]


def test_ecc_and_unreachable_are_problems(now):
    make_node("n", now=now, gpus=[{**card(0), "ecc_errors": 3, "fabric": None}])
    Node.objects.filter(id="n").update(unreachable_since=now)
    node = Node.objects.get(id="n")
    assert node_view.node_problems(node, None) == [
        f"heartbeats missing since {now}",
        "GPU 0: 3 uncorrected ECC errors",
    ]


def test_ports_with_live_rates(now):
    make_node("n", now=now, gpus=0)
    put_telemetry("n", ports=[ib_port("mlx5_1", sm="0x2", tx=1e9, rx=2e9), ib_port("mlx5_0", sm="0x2", state="DOWN")])
    ports = node_view.ib_ports({"ib_ports": [ib_port("mlx5_1", sm="0x2", tx=1e9, rx=2e9), {"bad": 1}]})
    assert [(p.hca, p.tx_bps, p.rx_bps, p.rate_gbps) for p in ports] == [("mlx5_1", 1e9, 2e9, 400)]
    page = node_view.node_page(Node.objects.get(id="n"))
    assert [(p.hca, p.state) for p in page.ports] == [("mlx5_0", "DOWN"), ("mlx5_1", "ACTIVE")]


def test_age_and_rate():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    assert node_view.age(None, now) == "never"
    assert node_view.age(now - dt.timedelta(seconds=42), now) == "42s"
    assert node_view.age(now - dt.timedelta(minutes=5), now) == "5m"
    assert node_view.age(now - dt.timedelta(hours=3), now) == "3h"
    assert node_view.age(now - dt.timedelta(days=4), now) == "4d"
    assert node_view.rate(2.5e9) == "2.5 Gb/s"
    assert node_view.rate(12) == "12 b/s"


def test_credential_box(now):
    from agents import credentials

    node = make_node("n", now=now, gpus=0)
    assert node_view.credential_box(node) == node_view.CredentialBox(present=False)
    credentials.issue("n", now=now, issued_by="rack 7")
    Node.objects.filter(id="n").update(last_seen=now + dt.timedelta(seconds=30))
    node.refresh_from_db()
    assert node_view.credential_box(node) == node_view.CredentialBox(
        present=True, issued_at=now, issued_by="rack 7", last_used=now + dt.timedelta(seconds=30)
    )
    credentials.request_rotation("n", now=now + dt.timedelta(minutes=1))
    box = node_view.credential_box(node)
    assert (box.rotation_requested_at, box.rotation_pending) == (now + dt.timedelta(minutes=1), False)
    credentials.rotate("n", now=now + dt.timedelta(minutes=2))
    box = node_view.credential_box(node)
    assert (box.issued_at, box.issued_by, box.rotation_requested_at, box.rotation_pending) == (
        now + dt.timedelta(minutes=2),
        "rotation",
        None,
        True,
    )
