"""GPUs through NVML (the `pynvml` module of nvidia-ml-py).

The handle calls are kept in `query_device`, which returns plain values in
NVML's own units (bytes, milliwatts, enum numbers); `reading_from_nvml` turns
them into a `GPUReading` and is tested on recorded values. A missing NVML
library or driver is a reported problem, never a crash.
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

import llmgw_wire as wire

from .readings import GPUReading

FABRIC_STATES = {0: "Not Supported", 1: "Not Started", 2: "In Progress", 3: "Completed"}
# NVML's throttle ("clocks event") reason bits, idle left out: an idle card is not throttled.
THROTTLE_BITS = {
    0x2: "Applications Clocks Setting",
    0x4: "SW Power Cap",
    0x8: "HW Slowdown",
    0x10: "Sync Boost",
    0x20: "SW Thermal Slowdown",
    0x40: "HW Thermal Slowdown",
    0x80: "HW Power Brake Slowdown",
    0x100: "Display Clock Setting",
}
_BANDWIDTH = {0: "", 1: "Degraded", 2: "Full"}
# NVML_GPU_FABRIC_HEALTH_SUMMARY_*: 0 is a driver that does not say.
_HEALTH_SUMMARY = {0: "", 1: "Healthy", 2: "Unhealthy", 3: "Limited Capacity"}


def _status_name(code: int) -> str:
    return "Success" if code == 0 else f"NVML error {code}"


def fabric_from_nvml(raw: dict[str, Any] | None) -> wire.GPUFabric | None:
    """NVML's fabric info ({state, status, cluster_uuid: 16 bytes, clique_id, health_mask, health_summary})
    as the wire has it; health_summary is absent where only fabric info v2 answered."""
    if not raw:
        return None
    state = FABRIC_STATES.get(int(raw.get("state", 0)), str(raw.get("state")))
    if state == "Not Supported":
        return None
    cu = bytes(raw.get("cluster_uuid") or b"")
    cluster = str(uuidlib.UUID(bytes=cu)) if len(cu) == 16 else ""
    mask = raw.get("health_mask")
    bandwidth = _BANDWIDTH.get(int(mask) & 0x3, "") if mask is not None else ""
    return wire.GPUFabric(
        state=state,
        status=_status_name(int(raw.get("status", 0))) if state == "Completed" else "",
        cluster_uuid=cluster,
        clique_id=str(raw.get("clique_id", "")),
        bandwidth=bandwidth,
        health=_HEALTH_SUMMARY.get(int(raw["health_summary"]), "") if raw.get("health_summary") is not None else "",
    )


def _mb(v: Any) -> int | None:
    return int(v) // (1024 * 1024) if isinstance(v, int) else None


def _w(v: Any) -> float | None:
    return round(v / 1000.0, 2) if isinstance(v, int | float) else None


# The DL (data link) error counters per link, by their names in the `nvlink` readings. A flit CRC
# and a data CRC error are both a corrupted transfer the link had to retry, so they count as one.
NVLINK_COUNTERS = {"crc": ("crc_flit", "crc_data"), "replay": ("replay",), "recovery": ("recovery",)}


def nvlink_errors_from_nvml(links: list[dict[str, Any]] | None) -> tuple[int, int, int]:
    """(CRC, replay, recovery) errors summed over a card's active NVLinks; -1 for a count not read.

    `links` is what `query_device` records per link: {link, active, crc_flit, crc_data, replay,
    recovery}, a counter None where NVML answered NotSupported. A link that is down is skipped: its
    counters describe a link that carries no traffic (they may be stale from before it went down).
    A card without NVLink has no link readings and keeps -1 (not read), never 0 (read, clean).
    """
    totals: list[int] = []
    for keys in NVLINK_COUNTERS.values():
        values = [
            int(link[k])
            for link in links or []
            if link.get("active") == 1
            for k in keys
            if isinstance(link.get(k), int)
        ]
        totals.append(sum(values) if values else -1)
    return totals[0], totals[1], totals[2]


def reading_from_nvml(index: int, raw: dict[str, Any], *, driver: str = "", cuda: str = "") -> GPUReading:
    """One card's NVML values (as `query_device` returns them) as a GPUReading."""
    cc = raw.get("compute_capability")
    reasons = raw.get("throttle_reasons")
    retired = raw.get("retired_pages") or {}
    remap = raw.get("remapped_rows")
    nvlink = nvlink_errors_from_nvml(raw.get("nvlink"))
    return GPUReading(
        index=index,
        uuid=raw.get("uuid", ""),
        name=raw.get("name", ""),
        pci_bus_id=raw.get("pci_bus_id", ""),
        memory_total_mb=_mb(raw.get("memory_total")),
        memory_used_mb=_mb(raw.get("memory_used")),
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else "",
        driver_version=driver,
        cuda_version=cuda,
        utilization_percent=raw.get("utilization_gpu"),
        memory_utilization_percent=raw.get("utilization_memory"),
        temperature_c=raw.get("temperature"),
        memory_temperature_c=raw.get("memory_temperature"),
        power_w=_w(raw.get("power_mw")),
        power_limit_w=_w(raw.get("power_limit_mw")),
        sm_clock_mhz=raw.get("sm_clock_mhz"),
        throttle=[name for bit, name in THROTTLE_BITS.items() if isinstance(reasons, int) and reasons & bit],
        ecc_uncorrected=raw.get("ecc_uncorrected_volatile"),
        processes=list(raw.get("pids", [])),
        pcie_replays=raw.get("pcie_replays", -1),
        retired_pages_sbe=retired.get("sbe", -1),
        retired_pages_dbe=retired.get("dbe", -1),
        retire_pending=bool(retired.get("pending", False)),
        remapped_rows_correctable=remap[0] if remap else -1,
        remapped_rows_uncorrectable=remap[1] if remap else -1,
        remap_pending=bool(remap[2]) if remap else False,
        remap_failure=bool(remap[3]) if remap else False,
        nvlink_crc_errors=nvlink[0],
        nvlink_replay_errors=nvlink[1],
        nvlink_recovery_errors=nvlink[2],
        fabric=fabric_from_nvml(raw.get("fabric")),
        numa_node=raw.get("numa_node"),
    )


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and kin: the card does not say
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def query_device(nvml: Any, handle: Any) -> dict[str, Any]:
    """Every value the agent reads from one NVML handle, in NVML's units."""
    raw: dict[str, Any] = {
        "uuid": _text(_try(nvml.nvmlDeviceGetUUID, handle)),
        "name": _text(_try(nvml.nvmlDeviceGetName, handle)),
    }
    pci = _try(nvml.nvmlDeviceGetPciInfo, handle)
    raw["pci_bus_id"] = _text(getattr(pci, "busId", "")) if pci else ""
    mem = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
    if mem:
        raw["memory_total"], raw["memory_used"] = int(mem.total), int(mem.used)
    raw["compute_capability"] = _try(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    util = _try(nvml.nvmlDeviceGetUtilizationRates, handle)
    if util:
        raw["utilization_gpu"], raw["utilization_memory"] = int(util.gpu), int(util.memory)
    raw["temperature"] = _try(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    raw["power_mw"] = _try(nvml.nvmlDeviceGetPowerUsage, handle)
    raw["power_limit_mw"] = _try(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    raw["sm_clock_mhz"] = _try(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
    raw["throttle_reasons"] = _try(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
    raw["ecc_uncorrected_volatile"] = _try(
        nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
    )
    procs = _try(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    raw["pids"] = sorted({int(p.pid) for p in procs})
    raw["pcie_replays"] = _try(nvml.nvmlDeviceGetPcieReplayCounter, handle)
    remap = _try(nvml.nvmlDeviceGetRemappedRows, handle)
    raw["remapped_rows"] = list(remap) if remap else None
    sbe = _try(nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = _try(nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pending = _try(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if sbe is not None or dbe is not None:
        raw["retired_pages"] = {"sbe": len(sbe or []), "dbe": len(dbe or []), "pending": bool(pending)}
    fabric = _try(_fabric_info, nvml, handle)
    raw["fabric"] = fabric
    raw["nvlink"] = _nvlink_links(nvml, handle) or None
    return {k: v for k, v in raw.items() if v is not None}


def _fabric_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """Fabric info v3 (with the health summary) first, v2 where the driver or binding lacks it.

    The health mask's bandwidth bits alone miss a card the driver calls
    Unhealthy with full bandwidth; only v3 carries the summary.
    """
    info = None
    v3 = getattr(nvml, "c_nvmlGpuFabricInfo_v3_t", None)
    if v3 is not None:
        try:
            info = v3()
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, info)
        except Exception:  # an older driver answers v3 with a version mismatch
            info = None
    if info is None:
        info = nvml.c_nvmlGpuFabricInfoV_t()
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, info)
    out = {
        "state": int(info.state),
        "status": int(info.status),
        "cluster_uuid": bytes(info.clusterUuid),
        "clique_id": int(info.cliqueId),
        "health_mask": int(getattr(info, "healthMask", 0)),
    }
    if hasattr(info, "healthSummary"):
        out["health_summary"] = int(info.healthSummary)
    return out


def _nvlink_links(nvml: Any, handle: Any) -> list[dict[str, Any]]:
    """Each NVLink's state and, for an active one, its DL error counters (None where not supported)."""
    counters = {
        "crc_flit": getattr(nvml, "NVML_NVLINK_ERROR_DL_CRC_FLIT", None),
        "crc_data": getattr(nvml, "NVML_NVLINK_ERROR_DL_CRC_DATA", None),
        "replay": getattr(nvml, "NVML_NVLINK_ERROR_DL_REPLAY", None),
        "recovery": getattr(nvml, "NVML_NVLINK_ERROR_DL_RECOVERY", None),
    }
    links: list[dict[str, Any]] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as exc:
            if type(exc).__name__ == "NVMLError_NotSupported":
                break  # a card without NVLink: every other link would say the same
            continue  # a link number past this card's last link (InvalidArgument)
        entry: dict[str, Any] = {"link": link, "active": int(state)}
        if int(state) == 1:
            for name, counter in counters.items():
                value = (
                    _try(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter) if counter is not None else None
                )
                entry[name] = int(value) if isinstance(value, int) else None
        links.append(entry)
    return links


def read_nvml() -> tuple[list[GPUReading], list[str], bool]:
    """Every card NVML sees; (readings, problems, whether NVML answered at all)."""
    try:
        import pynvml as nvml
    except ImportError as exc:
        return [], [f"NVML: the pynvml module is missing ({exc})"], False
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return [], [f"NVML library not usable: {exc}"], False
    try:
        driver = _text(_try(nvml.nvmlSystemGetDriverVersion))
        cv = _try(nvml.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cv // 1000}.{(cv % 1000) // 10}" if isinstance(cv, int) else ""
        out: list[GPUReading] = []
        problems: list[str] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = _try(nvml.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                problems.append(f"GPU {i}: NVML cannot open it")
                continue
            out.append(reading_from_nvml(i, query_device(nvml, handle), driver=driver, cuda=cuda))
        return out, problems, True
    except Exception as exc:
        return [], [f"NVML: {exc}"], False
    finally:
        _try(nvml.nvmlShutdown)
