from inventory.gpus import gpu_domain
from llmgw_agent.discovery import nvidia_smi
from llmgw_agent.discovery.readings import reading_problems


def test_gh200_full_output(fixture_text):
    r = nvidia_smi.parse_query(fixture_text("nvidia-smi-q/gh200-480gb-1gpu.txt"))
    assert (r.driver_version, r.cuda_version, len(r.gpus)) == ("550.127.05", "12.4", 1)
    g = r.gpus[0]
    assert g.uuid == "GPU-35d58415-1094-5ad1-64d1-b797587d33a7"
    assert g.name == "NVIDIA GH200 480GB"
    assert g.pci_bus_id == "00000000:DD:00.0"
    assert (g.memory_total_mb, g.memory_used_mb) == (97871, 2)
    assert (g.temperature_c, g.memory_temperature_c, g.power_w, g.power_limit_w, g.sm_clock_mhz) == (
        31,
        39,
        87.88,
        700.0,
        345,
    )
    assert (g.pcie_replays, g.retired_pages_sbe, g.remapped_rows_uncorrectable, g.remap_failure) == (0, -1, 1, False)
    assert g.ecc_uncorrected == 0
    assert g.throttle == []
    assert g.fabric is None
    assert reading_problems(g) == []


def test_hgx_h100_single_node_nvswitch_is_no_domain(fixture_text):
    r = nvidia_smi.parse_query(fixture_text("nvidia-smi-q/h100-hgx-8gpu-excerpt.txt"))
    assert len(r.gpus) == 8
    assert [g.pci_bus_id[9:11] for g in r.gpus] == ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
    assert r.gpus[6].uuid == "GPU-83a5aebb-b71c-c570-aa83-185e1233fe97"
    assert [g.pcie_replays for g in r.gpus] == [7, 0, 0, 0, 0, 4, 15, 0]
    f = r.gpus[0].fabric
    assert (f.state, f.status, f.clique_id, f.cluster_uuid) == (
        "Completed",
        "Success",
        "0",
        "00000000-0000-0000-0000-000000000000",
    )
    assert all(
        gpu_domain(g.fabric.state, g.fabric.status, g.fabric.cluster_uuid, g.fabric.clique_id) == "" for g in r.gpus
    )


def test_gb200_tray_joined(fixture_text):
    r = nvidia_smi.parse_query(fixture_text("nvidia-smi-q/gb200-tray-joined.txt"))
    assert [g.memory_total_mb for g in r.gpus] == [189471] * 4
    assert {(g.fabric.cluster_uuid, g.fabric.clique_id, g.fabric.bandwidth) for g in r.gpus} == {
        ("9c6f5af3-53bf-49b5-a436-b66766c413c3", "4026", "Full")
    }
    assert r.gpus[3].pci_bus_id == "00000019:01:00.0"


def test_gb200_half_joined(fixture_text):
    r = nvidia_smi.parse_query(fixture_text("nvidia-smi-q/gb200-tray-half-joined.txt"))
    assert [g.fabric.state for g in r.gpus] == ["Completed", "Completed", "In Progress", "In Progress"]
    assert r.gpus[2].fabric.cluster_uuid == ""


def test_fabric_unhealthy_summary_and_insufficient_resources(fixture_text):
    tree = nvidia_smi.parse_tree(fixture_text("nvidia-smi-q/gb200-fabric-unhealthy-excerpt.txt").splitlines())
    f = nvidia_smi.parse_fabric(tree["Fabric"])
    assert (f.state, f.clique_id, f.cluster_uuid, f.bandwidth, f.health) == (
        "Completed",
        "2",
        "dc6e40c4-d722-4357-9ba6-5291dd461278",
        "Full",
        "Unhealthy",
    )
    tree = nvidia_smi.parse_tree(fixture_text("nvidia-smi-q/fabric-insufficient-resources-excerpt.txt").splitlines())
    f = nvidia_smi.parse_fabric(tree["Fabric"])
    assert (f.status, f.clique_id) == ("Insufficient Resources", "0")
    assert gpu_domain(f.state, f.status, f.cluster_uuid, f.clique_id) == ""


def test_driver_610_reads_the_new_version_keys_without_their_notes(fixture_text):
    header = fixture_text("nvidia-smi-q/driver-610-header.txt")
    r = nvidia_smi.parse_query(header)
    assert (r.driver_version, r.cuda_version) == ("610.47", "13.3")
    # Once the deprecated keys are gone, the new ones still say it.
    kept = [line for line in header.splitlines() if "Deprecated" not in line]
    assert nvidia_smi.parse_query("\n".join(kept)).driver_version == "610.47"
    # Only the deprecated keys (as a driver between the two might print): the note is stripped.
    old = [line for line in header.splitlines() if "Deprecated" in line or "NVSMI" in line]
    r = nvidia_smi.parse_query("\n".join(old))
    assert (r.driver_version, r.cuda_version) == ("610.47", "13.3")


def test_driver_610_card_carries_its_fabric_health(fixture_text):
    # The 610 header (its wide key column) followed by a GB200 card whose Fabric section is the
    # recorded unhealthy one: every card of the report takes the KMD version, and the summary.
    text = (
        fixture_text("nvidia-smi-q/driver-610-header.txt")
        + "\nGPU 00000008:01:00.0\n"
        + fixture_text("nvidia-smi-q/gb200-fabric-unhealthy-excerpt.txt")
    )
    r = nvidia_smi.parse_query(text)
    g = r.gpus[0]
    assert (g.driver_version, g.cuda_version, g.fabric.health, g.fabric.state) == (
        "610.47",
        "13.3",
        "Unhealthy",
        "Completed",
    )
