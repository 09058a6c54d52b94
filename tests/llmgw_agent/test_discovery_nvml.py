"""NVLink error counters: per-link NVML readings summed over a card's active links, and carried to the heartbeat."""

from __future__ import annotations

import pynvml

from llmgw_agent.discovery import nvml
from llmgw_agent.discovery.readings import GPUReading, to_sensor

# Per-link readings in the shape `query_device` records them: three active links with errors, one
# down, and one counter (data CRC on link 1) that NVML answered NotSupported.
H100_LINKS = [
    {"link": 0, "active": 1, "crc_flit": 3, "crc_data": 2, "replay": 1, "recovery": 0},
    {"link": 1, "active": 1, "crc_flit": 4, "crc_data": None, "replay": 0, "recovery": 2},
    {"link": 2, "active": 0},
    {"link": 3, "active": 1, "crc_flit": 0, "crc_data": 0, "replay": 5, "recovery": 0},
]


def test_counters_are_summed_over_active_links():
    assert nvml.nvlink_errors_from_nvml(H100_LINKS) == (9, 6, 2)


def test_a_down_link_is_skipped_even_with_counts():
    links = [
        {"link": 0, "active": 1, "crc_flit": 1, "crc_data": 0, "replay": 0, "recovery": 0},
        {"link": 1, "active": 0, "crc_flit": 500, "crc_data": 7, "replay": 9, "recovery": 4},
    ]
    assert nvml.nvlink_errors_from_nvml(links) == (1, 0, 0)


def test_not_supported_keeps_minus_one():
    assert nvml.nvlink_errors_from_nvml(None) == (-1, -1, -1)
    assert nvml.nvlink_errors_from_nvml([]) == (-1, -1, -1)
    # NVLink present but every counter NotSupported: not read, never a clean 0.
    unsupported = [{"link": 0, "active": 1, "crc_flit": None, "crc_data": None, "replay": None, "recovery": None}]
    assert nvml.nvlink_errors_from_nvml(unsupported) == (-1, -1, -1)
    # Only the replay counter answered.
    partial = [{"link": 0, "active": 1, "crc_flit": None, "crc_data": None, "replay": 0, "recovery": None}]
    assert nvml.nvlink_errors_from_nvml(partial) == (-1, 0, -1)
    # Every link down: nothing read.
    assert nvml.nvlink_errors_from_nvml([{"link": 0, "active": 0}, {"link": 1, "active": 0}]) == (-1, -1, -1)


def test_reading_carries_the_sums():
    r = nvml.reading_from_nvml(0, {"uuid": "GPU-1", "nvlink": H100_LINKS})
    assert (r.nvlink_crc_errors, r.nvlink_replay_errors, r.nvlink_recovery_errors) == (9, 6, 2)
    bare = nvml.reading_from_nvml(0, {"uuid": "GPU-2"})
    assert (bare.nvlink_crc_errors, bare.nvlink_replay_errors, bare.nvlink_recovery_errors) == (-1, -1, -1)


class RecordedNVML:
    """Replays NVML's recorded answers for one card: link -> state, (link, counter) -> value or an error."""

    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_NVLINK_ERROR_DL_CRC_FLIT = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_ERROR_DL_CRC_DATA = pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA
    NVML_NVLINK_ERROR_DL_REPLAY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY

    def __init__(self, states: dict[int, int], counters: dict[tuple[int, int], int], *, supported: bool = True):
        self.states, self.counters, self.supported = states, counters, supported
        self.calls = 0

    def nvmlDeviceGetNvLinkState(self, handle, link):
        self.calls += 1
        if not self.supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link not in self.states:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.states[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, handle, link, counter):
        if (link, counter) not in self.counters:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.counters[(link, counter)]


def test_links_are_read_with_nvmls_own_errors():
    crc, replay, recovery = (
        pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
        pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    )
    recorded = RecordedNVML(
        {0: 1, 1: 0, 2: 1},
        {(0, crc): 3, (0, replay): 1, (0, recovery): 0, (1, crc): 99, (2, crc): 1, (2, replay): 0, (2, recovery): 2},
    )
    links = nvml._nvlink_links(recorded, handle=None)
    assert links == [
        {"link": 0, "active": 1, "crc_flit": 3, "crc_data": None, "replay": 1, "recovery": 0},
        {"link": 1, "active": 0},
        {"link": 2, "active": 1, "crc_flit": 1, "crc_data": None, "replay": 0, "recovery": 2},
    ]
    assert nvml.nvlink_errors_from_nvml(links) == (4, 1, 2)


def test_a_card_without_nvlink_is_asked_once():
    pcie = RecordedNVML({}, {}, supported=False)
    assert nvml._nvlink_links(pcie, handle=None) == []
    assert pcie.calls == 1


def test_every_wear_counter_of_a_reading_reaches_the_heartbeat():
    counters = {
        "pcie_replays": 1,
        "retired_pages_sbe": 2,
        "retired_pages_dbe": 3,
        "retire_pending": True,
        "remapped_rows_correctable": 4,
        "remapped_rows_uncorrectable": 5,
        "remap_pending": True,
        "remap_failure": True,
        "nvlink_crc_errors": 6,
        "nvlink_replay_errors": 7,
        "nvlink_recovery_errors": 8,
    }
    wear = to_sensor(GPUReading(index=0, **counters)).wear
    assert wear.model_dump(include=set(counters)) == counters
    # XIDs are not a reading's: they stay "not reported" until the kernel's log is read.
    assert (wear.xid_errors, wear.last_xid, wear.last_xid_text) == (-1, 0, "")


class FabricNVML:
    """The fabric call of a driver: with fabric info v3 (health summary), or one that refuses v3."""

    c_nvmlGpuFabricInfo_v3_t = pynvml.c_nvmlGpuFabricInfo_v3_t
    c_nvmlGpuFabricInfoV_t = pynvml.c_nvmlGpuFabricInfoV_t

    def __init__(self, *, v3: bool, summary: int = 0, mask: int = 0) -> None:
        self.v3, self.summary, self.mask = v3, summary, mask

    def nvmlDeviceGetGpuFabricInfoV(self, handle, info):
        if isinstance(info, pynvml.c_nvmlGpuFabricInfo_v3_t):
            if not self.v3:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            info.healthSummary = self.summary
        info.state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        info.status = 0
        info.cliqueId = 2
        info.healthMask = self.mask
        for i, b in enumerate(bytes.fromhex("dc6e40c4d72243579ba65291dd461278")):
            info.clusterUuid[i] = b
        return 0


def test_fabric_health_summary_is_read_from_fabric_info_v3():
    # Unhealthy with full bandwidth (the bandwidth bits alone would call this card fine).
    raw = nvml._fabric_info(
        FabricNVML(v3=True, summary=pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY, mask=2), handle=None
    )
    f = nvml.fabric_from_nvml(raw)
    assert (f.state, f.cluster_uuid, f.clique_id, f.bandwidth, f.health) == (
        "Completed",
        "dc6e40c4-d722-4357-9ba6-5291dd461278",
        "2",
        "Full",
        "Unhealthy",
    )
    limited = nvml._fabric_info(
        FabricNVML(v3=True, summary=pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY), handle=None
    )
    assert nvml.fabric_from_nvml(limited).health == "Limited Capacity"


def test_a_driver_without_fabric_info_v3_falls_back_to_v2_and_says_nothing_of_health():
    raw = nvml._fabric_info(FabricNVML(v3=False, mask=1), handle=None)
    assert "health_summary" not in raw
    f = nvml.fabric_from_nvml(raw)
    assert (f.bandwidth, f.health) == ("Degraded", "")
