"""One GPU as read from NVML or from `nvidia-smi -q`, and its wire forms.

Both sources land in the same `GPUReading`, so the registration and the
heartbeat are built by one piece of code whichever source answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llmgw_wire as wire

from . import health


@dataclass
class GPUReading:
    """What one card reports; None or -1 where the source does not say."""

    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    memory_total_mb: int | None = None
    memory_used_mb: int | None = None
    compute_capability: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    temperature_c: int | None = None
    memory_temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    throttle: list[str] = field(default_factory=list)
    ecc_uncorrected: int | None = None
    processes: list[int] = field(default_factory=list)
    pcie_replays: int = -1
    retired_pages_sbe: int = -1
    retired_pages_dbe: int = -1
    retire_pending: bool = False
    remapped_rows_correctable: int = -1
    remapped_rows_uncorrectable: int = -1
    remap_pending: bool = False
    remap_failure: bool = False
    nvlink_crc_errors: int = -1
    nvlink_replay_errors: int = -1
    nvlink_recovery_errors: int = -1
    fabric: wire.GPUFabric | None = None
    numa_node: int | None = None


def retired_pages(r: GPUReading) -> int:
    """Pages retired for either kind of ECC error (0 when not reported)."""
    return max(r.retired_pages_sbe, 0) + max(r.retired_pages_dbe, 0)


def reading_problems(r: GPUReading, *, foreign_pids: list[int] | None = None) -> list[str]:
    """What keeps a card from being free, apart from XIDs and replay rates."""
    out = health.wear_problems(
        remap_failure=r.remap_failure,
        remap_pending=r.remap_pending,
        retire_pending=r.retire_pending,
        retired_pages=retired_pages(r),
        replays_per_minute=None,
    )
    if r.ecc_uncorrected:
        out.append(f"{r.ecc_uncorrected} uncorrected ECC errors since the last reset")
    pids = r.processes if foreign_pids is None else foreign_pids
    if pids:
        out.append("used by a process llmgw did not start: pid " + ", ".join(str(p) for p in pids))
    return out


def to_gpu(
    r: GPUReading, *, nic_paths: dict[str, str] | None = None, nvlink_peers: list[int] | None = None
) -> wire.GPU:
    """The registration's view of a card."""
    return wire.GPU(
        index=r.index,
        uuid=r.uuid,
        name=r.name,
        memory_total_mb=r.memory_total_mb,
        memory_used_mb=r.memory_used_mb,
        compute_capability=r.compute_capability,
        numa_node=r.numa_node,
        pci_bus_id=r.pci_bus_id,
        driver_version=r.driver_version,
        cuda_version=r.cuda_version,
        utilization_percent=r.utilization_percent,
        nvlink_peers=sorted(nvlink_peers or []),
        nic_paths=dict(nic_paths or {}),
        fabric=r.fabric,
        ecc_errors=r.ecc_uncorrected,
        temperature_c=r.temperature_c,
        problems=reading_problems(r),
    )


def to_wear(r: GPUReading) -> wire.GPUWear:
    """The wear counters of a card, read field by field under GPUWear's own names.

    XIDs are not a reading's (they come from the kernel or NVML events): those
    fields keep GPUWear's "not reported" defaults.
    """
    return wire.GPUWear.model_validate(r, from_attributes=True)


def to_sensor(r: GPUReading) -> wire.GPUSensor:
    """The heartbeat's view of a card: heat, power, busyness and wear."""
    return wire.GPUSensor(
        index=r.index,
        temp_c=float(r.temperature_c or 0),
        memory_temp_c=float(r.memory_temperature_c or 0),
        power_w=float(r.power_w or 0.0),
        power_limit_w=float(r.power_limit_w or 0.0),
        throttle=list(r.throttle),
        util_percent=float(r.utilization_percent) if r.utilization_percent is not None else -1,
        mem_util_percent=float(r.memory_utilization_percent) if r.memory_utilization_percent is not None else -1,
        memory_used_mb=float(r.memory_used_mb or 0),
        memory_total_mb=float(r.memory_total_mb or 0),
        sm_clock_mhz=float(r.sm_clock_mhz or 0),
        ecc_uncorrected=float(r.ecc_uncorrected or 0),
        wear=to_wear(r),
        problems=reading_problems(r),
    )
