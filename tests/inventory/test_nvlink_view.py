"""NVLink racks: which tray is in, which is out and why."""

import pytest

from inventory import nvlink_view
from inventory.models import Node
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import CLUSTER, card, nvlink_cluster, tray

pytestmark = pytest.mark.django_db


def trays_by_node(racks):
    return {t.node_id: (r.domain, t) for r in racks for t in r.trays}


def test_joined_half_joined_and_degraded_trays(now):
    nvlink_cluster(now)
    (rack,) = nvlink_view.racks()
    assert rack.domain == f"{CLUSTER}/7"
    assert (rack.cluster_uuid, rack.clique, rack.joined) == (CLUSTER, "7", 2)
    t = {x.node_id: x for x in rack.trays}
    assert (t["tray-joined"].state, t["tray-joined"].reasons, t["tray-joined"].warnings) == ("joined", [], [])
    assert [c.state for c in t["tray-half"].cards] == ["joined", "joined", "not-joined", "not-joined"]
    assert t["tray-half"].state == "out"
    assert t["tray-degraded"].state == "degraded"
    assert t["tray-degraded"].warnings == ["GPU 1 NVLink bandwidth degraded (Degraded (50%))"]
    assert [c.state for c in t["tray-degraded"].cards] == ["joined", "degraded", "joined", "joined"]


def test_what_keeps_a_tray_out(now):
    tray("imex-down", now=now, imex="DOWN")
    make_node(
        "no-channel",
        now=now,
        gpus=[card(i) for i in range(4)],
        imex={"state": "UP", "channels": 0},
    )
    tray("cordoned", now=now)
    change_state("cordoned", "cordoned", now=now)
    tray("silent", now=now)
    Node.objects.filter(id="silent").update(unreachable_since=now)
    got = trays_by_node(nvlink_view.racks())
    assert got["imex-down"][1].reasons == ["IMEX down (DOWN)"]
    assert got["no-channel"][1].reasons == ["no IMEX channel"]
    assert got["cordoned"][1].reasons == ["node not ready (cordoned)"]
    assert got["silent"][1].reasons == ["node not ready (ready, heartbeats missing)"]
    assert {d for d, _ in got.values()} == {f"{CLUSTER}/7"}


def test_card_in_another_domain_and_domains_sorted(now):
    other = "ffffffff-0000-4000-8000-000000000001"
    make_node("split", now=now, gpus=[card(0), card(1, cluster=other)], imex={"state": "UP", "channels": 1})
    tray("b-tray", now=now)
    make_node(
        "second", now=now, gpus=[card(0, cluster=other), card(1, cluster=other)], imex={"state": "UP", "channels": 1}
    )
    racks = nvlink_view.racks()
    assert [r.domain for r in racks] == [f"{CLUSTER}/7", f"{other}/7"]
    split = trays_by_node(racks)["split"]
    assert split[0] == f"{CLUSTER}/7"
    assert split[1].reasons == [f"GPU 1 joined another domain ({other}/7)"]


def test_pcie_nodes_are_left_out_and_fabricless_cards_go_to_no_domain(now):
    make_node("pcie", now=now, gpus=2)
    make_node(
        "dropped",
        now=now,
        gpus=[{**card(0), "fabric": {"state": "Not Started", "status": "N/A", "cluster_uuid": "", "clique_id": ""}}],
    )
    racks = nvlink_view.racks()
    assert [(r.domain, [t.node_id for t in r.trays]) for r in racks] == [("", ["dropped"])]
    assert racks[0].trays[0].reasons[0] == "GPU 0 not joined (Not Started, N/A)"


def test_single_box_nvswitch_zero_uuid_is_no_domain(now):
    zero = "00000000-0000-0000-0000-000000000000"
    make_node("hgx", now=now, gpus=[card(0, cluster=zero)])
    (rack,) = nvlink_view.racks()
    assert rack.domain == ""


def test_a_tray_still_joining_is_drawn_in_its_clusters_rack(now):
    # No card joined yet, but they already name their cluster: the tray belongs in that rack, out.
    tray("joining", now=now, joined=(False, False, False, False))
    (rack,) = nvlink_view.racks()
    assert rack.domain == f"{CLUSTER}/7"
    (t,) = rack.trays
    assert (t.node_id, t.state) == ("joining", "out")
    assert t.reasons[0] == "GPU 0 not joined (In Progress, N/A)"
