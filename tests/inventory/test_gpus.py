"""GPU rules: class, health, wear problems and NVLink domains (seed: multi-node NVLink)."""

import pytest

import llmgw_wire as wire
from inventory import gpus
from tests.factories import gpu_payload, make_node

ZEROS = "00000000-0000-0000-0000-000000000000"
CLUSTER = "5e9b6f0a-1f5c-4d7e-9a3b-2c1d0e9f8a7b"


def joined(cluster=CLUSTER, clique="32766", bandwidth="Full"):
    return {
        "state": "Completed",
        "status": "Success",
        "cluster_uuid": cluster,
        "clique_id": clique,
        "bandwidth": bandwidth,
    }


@pytest.mark.parametrize(
    ("name", "memory", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA GB200", 189471, "GB200-185GB"),
        ("NVIDIA H200", 143771, "H200-140GB"),
        ("NVIDIA L40S", 46068, "L40S-45GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
        ("", 0, ""),
    ],
)
def test_gpu_class(name, memory, expected):
    assert gpus.gpu_class(name, memory) == expected


def test_health_skips_ecc_faults_and_problems():
    assert gpus.healthy(0, []) is True
    assert gpus.healthy(None, None) is True
    assert gpus.healthy(2, []) is False
    assert gpus.healthy(0, ["foreign process 4711 (python3) holds the card"]) is False


def test_a_card_is_joined_only_when_completed_successful_and_not_zero():
    assert gpus.fabric_joined("Completed", "Success", CLUSTER) is True
    assert gpus.fabric_joined("Completed", "Success", ZEROS) is False
    assert gpus.fabric_joined("In Progress", "N/A", CLUSTER) is False
    assert gpus.fabric_joined("Completed", "Failure", CLUSTER) is False
    assert gpus.fabric_joined("N/A", "N/A", "N/A") is False


def test_a_card_reports_a_fabric_unless_it_says_it_has_none():
    for none in ("", "N/A", "Not Supported", "not_supported", " n/a "):
        assert gpus.fabric_reported(none) is False, none
    for some in ("Not Started", "In Progress", "Completed"):
        assert gpus.fabric_reported(some) is True, some


def test_domain_names_and_known_clusters():
    assert gpus.cluster_known(CLUSTER) is True
    assert gpus.cluster_known(ZEROS) is False
    assert gpus.cluster_known("N/A") is False
    assert gpus.cluster_known("") is False
    assert gpus.domain_name(f" {CLUSTER} ", " 7 ") == f"{CLUSTER}/7"
    assert gpus.domain_name(CLUSTER, "N/A") == CLUSTER
    assert gpus.domain_name(CLUSTER, "") == CLUSTER


@pytest.mark.django_db
def test_node_domain_when_every_card_is_joined(now):
    node = make_node("gb200-01", now=now, gpus=[gpu_payload(i, fabric=joined()) for i in range(4)])
    assert node.nvlink_domain == f"{CLUSTER}/32766"
    assert [g.nvlink_domain for g in node.gpus.all()] == [f"{CLUSTER}/32766"] * 4


@pytest.mark.django_db
def test_half_joined_node_is_in_no_domain(now):
    cards = [gpu_payload(i, fabric=joined()) for i in range(3)]
    cards.append(gpu_payload(3, fabric={"state": "In Progress", "status": "N/A", "cluster_uuid": CLUSTER}))
    assert make_node("half", now=now, gpus=cards).nvlink_domain == ""


@pytest.mark.django_db
def test_single_machine_nvswitch_with_zero_cluster_is_no_domain(now):
    cards = [gpu_payload(i, fabric=joined(cluster=ZEROS, clique="0")) for i in range(8)]
    assert make_node("hgx", now=now, gpus=cards).nvlink_domain == ""


def test_cards_in_two_domains_make_no_domain():
    class G:
        def __init__(self, cluster):
            self.fabric_state, self.fabric_status, self.cluster_uuid, self.clique_id = (
                "Completed",
                "Success",
                cluster,
                "1",
            )

    assert gpus.node_domain([G(CLUSTER), G(CLUSTER)]) == f"{CLUSTER}/1"
    assert gpus.node_domain([G(CLUSTER), G("11111111-2222-3333-4444-555555555555")]) == ""
    assert gpus.node_domain([]) == ""


def test_bandwidth_degraded():
    assert gpus.bandwidth_degraded("Full") is False
    assert gpus.bandwidth_degraded("") is False
    assert gpus.bandwidth_degraded("Degraded") is True


def test_imex_up():
    assert gpus.imex_up("UP") is True
    assert gpus.imex_up("READY") is True
    assert gpus.imex_up("DOWN") is False
    assert gpus.imex_up("") is False


def test_wear_problems_are_short_sentences():
    wear = wire.GPUWear(
        pcie_replays=3,
        retired_pages_sbe=1,
        retired_pages_dbe=2,
        retire_pending=True,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=5,
        remap_pending=True,
        remap_failure=True,
        nvlink_crc_errors=7,
        nvlink_replay_errors=1,
        nvlink_recovery_errors=0,
        xid_errors=1,
        last_xid=79,
        last_xid_text="GPU has fallen off the bus",
    )
    assert gpus.wear_problems(wear) == [
        "out of spare memory rows: replace the card",
        "memory rows remapped, waiting for a reset",
        "memory pages waiting for a reset to be retired",
        "5 rows remapped for uncorrectable errors",
        "2 pages retired for double-bit errors",
        "XID 79 (GPU has fallen off the bus): hardware or driver fault: drain and reboot the node; "
        "replace the card if it recurs",
        "NVLink errors: 7 CRC, 1 replay, 0 recovery",
    ]


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xids_point_at_the_engine(xid):
    assert gpus.xid_is_application(xid) is True
    assert gpus.xid_advice(xid).startswith("application fault: look at the engine's process")
    assert gpus.hardware_xid(wire.GPUWear(xid_errors=1, last_xid=xid)) is False


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 32])
def test_hardware_and_driver_xids_drain_and_reset_or_replace(xid):
    assert gpus.xid_is_application(xid) is False
    advice = gpus.xid_advice(xid)
    assert advice.startswith("hardware or driver fault: drain ")
    assert "reset" in advice or "reboot" in advice
    assert gpus.hardware_xid(wire.GPUWear(xid_errors=1, last_xid=xid)) is True


def test_unreported_wear_has_no_problems():
    assert gpus.wear_problems(None) == []
    assert gpus.wear_problems(wire.GPUWear()) == []


@pytest.mark.django_db
def test_a_node_whose_first_card_is_not_joined_is_in_no_domain(now):
    cards = [gpu_payload(0, fabric={"state": "In Progress", "status": "N/A", "cluster_uuid": CLUSTER})]
    cards += [gpu_payload(i, fabric=joined()) for i in range(1, 4)]
    assert make_node("late", now=now, gpus=cards).nvlink_domain == ""


def test_unreported_nvlink_counts_read_as_zero_beside_a_reported_one():
    assert gpus.wear_problems(wire.GPUWear(nvlink_replay_errors=2)) == ["NVLink errors: 0 CRC, 2 replay, 0 recovery"]
    assert gpus.wear_problems(wire.GPUWear(nvlink_crc_errors=3)) == ["NVLink errors: 3 CRC, 0 replay, 0 recovery"]
