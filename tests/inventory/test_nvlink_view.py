"""NVLink racks: which tray is in, which is out and why."""

import pytest

from inventory import nvlink_view
from inventory.models import Node
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import CLUSTER, card, nvlink_cluster, recorded_cards, tray

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


def test_a_single_hgx_machine_is_no_rack_but_a_machine_apart(now):
    # The recorded 8-GPU HGX H100: Completed / Success / cluster UUID of zeros on every card.
    make_node("hgx-h100", now=now, gpus=recorded_cards("h100-hgx-8gpu-excerpt.txt"))
    nvlink_cluster(now)
    racks, machines = nvlink_view.overview()
    assert [r.domain for r in racks] == [f"{CLUSTER}/7"]
    assert "hgx-h100" not in trays_by_node(racks)
    assert machines == [nvlink_view.Machine("hgx-h100", "hgx-h100.cluster", "ready", 8, "H100-80GB")]
    assert nvlink_view.racks() == racks


def test_a_card_that_failed_to_join_with_a_zero_cluster_stays_in_the_racks(now):
    # Completed with Insufficient Resources and a cluster of zeros (recorded on a GB200): it failed to join.
    failed = {
        "state": "Completed",
        "status": "Insufficient Resources",
        "cluster_uuid": "0" * 8 + "-0000-0000-0000-" + "0" * 12,
    }
    make_node("gb200-failed", now=now, gpus=[{**card(0), "fabric": {**failed, "clique_id": "0"}}])
    racks, machines = nvlink_view.overview()
    assert machines == []
    (rack,) = racks
    assert (rack.domain, rack.trays[0].reasons[0]) == ("", "GPU 0 not joined (Completed, Insufficient Resources)")


def test_an_unhealthy_card_keeps_its_tray_out_saying_why(now):
    cards = [card(i) for i in range(4)]
    cards[2]["fabric"] = {**cards[2]["fabric"], "health": "Unhealthy"}
    make_node("sick", now=now, gpus=cards, imex={"state": "UP", "channels": 1})
    (rack,) = nvlink_view.racks()
    (t,) = rack.trays
    assert (rack.domain, t.state, t.reasons) == (f"{CLUSTER}/7", "out", ["GPU 2 fabric health Unhealthy"])
    assert [c.state for c in t.cards] == ["joined", "joined", "not-joined", "joined"]


def test_a_tray_still_joining_is_drawn_in_its_clusters_rack(now):
    # No card joined yet, but they already name their cluster: the tray belongs in that rack, out.
    tray("joining", now=now, joined=(False, False, False, False))
    (rack,) = nvlink_view.racks()
    assert rack.domain == f"{CLUSTER}/7"
    (t,) = rack.trays
    assert (t.node_id, t.state) == ("joining", "out")
    assert t.reasons[0] == "GPU 0 not joined (In Progress, N/A)"
