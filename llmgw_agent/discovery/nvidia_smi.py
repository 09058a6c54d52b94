"""`nvidia-smi -q`: the cards, their wear and their NVLink fabric.

The text is an indented tree of "Key : value" lines and section headers.
NVML is the first choice on a live node; this parser serves a driver whose
NVML lacks the fabric call, a node whose NVML library is missing, and the
recorded node profiles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import llmgw_wire as wire

from .readings import GPUReading

_KV = re.compile(r"^(\s*)(\S.*?)\s+:\s?(.*)$")
_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# The 610 drivers append a note to values they mean to retire:
# "610.47 [Deprecated; will be removed in CUDA 14.0. Use KMD Version instead]".
_NOTE = re.compile(r"\s*\[[^\]]*\]\s*$")
_ABSENT = {
    "",
    "n/a",
    "not supported",
    "[n/a]",
    "[not supported]",
    "unknown error",
    "requested functionality has been deprecated",
}


@dataclass
class SmiReport:
    """A whole `nvidia-smi -q`: the driver and every card in enumeration order."""

    driver_version: str = ""
    cuda_version: str = ""
    gpus: list[GPUReading] = field(default_factory=list)


def parse_tree(lines: list[str]) -> dict[str, Any]:
    """An indented "Key : value" block as nested dicts; a repeated key becomes a list."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for raw in lines:
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        m = _KV.match(raw)
        if m:
            _put(parent, m.group(2).strip(), m.group(3).strip())
        else:
            child: dict[str, Any] = {}
            _put(parent, raw.strip(), child)
            stack.append((indent, child))
    return root


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    if key in d:
        prev = d[key]
        d[key] = [*prev, value] if isinstance(prev, list) else [prev, value]
    else:
        d[key] = value


def _s(d: Any, *path: str) -> str:
    """A string value at a path, "" when absent or not reported."""
    for p in path:
        if not isinstance(d, dict):
            return ""
        d = d.get(p)
    if isinstance(d, list):
        d = d[0] if d else ""
    if not isinstance(d, str):
        return ""
    return "" if d.strip().lower() in _ABSENT else d.strip()


def version(top: dict[str, Any], *keys: str) -> str:
    """The first of `keys` that the header gives, without a trailing bracketed note.

    The 610 drivers renamed "Driver Version" to "KMD Version" and "CUDA
    Version" to "CUDA UMD Version", keeping the old keys (with a deprecation
    note) for a while: the new keys are read first, the old ones serve older
    drivers and will serve nothing once removed.
    """
    for key in keys:
        value = _NOTE.sub("", _s(top, key))
        if value:
            return value
    return ""


def _num(d: Any, *path: str) -> float | None:
    m = _NUMBER.search(_s(d, *path))
    return float(m.group(0)) if m else None


def _int(d: Any, *path: str) -> int | None:
    v = _num(d, *path)
    return int(v) if v is not None else None


def _count(d: Any, *path: str) -> int:
    """A wear counter: -1 when the card does not report it."""
    v = _int(d, *path)
    return -1 if v is None else v


def _yes(d: Any, *path: str) -> bool:
    return _s(d, *path).lower() == "yes"


def parse_fabric(block: Any) -> wire.GPUFabric | None:
    """The "Fabric" section of one card; None when the card has none to report."""
    if not isinstance(block, dict):
        return None
    state = _s(block, "State")
    if not state:
        return None
    return wire.GPUFabric(
        state=state,
        status=_s(block, "Status"),
        cluster_uuid=_s(block, "ClusterUUID"),
        clique_id=_s(block, "CliqueId"),
        bandwidth=_s(block, "Health", "Bandwidth"),
        # The driver's own verdict on the card's fabric: a card can be joined
        # (Completed, Success) and still say Unhealthy, and NCCL over it fails.
        health=_s(block, "Health", "Summary"),
    )


def _processes(block: Any) -> list[int]:
    if not isinstance(block, dict):
        return []
    pids = block.get("Process ID", [])
    pids = pids if isinstance(pids, list) else [pids]
    return [int(p) for p in pids if isinstance(p, str) and p.strip().isdigit()]


def _throttle(block: Any) -> list[str]:
    if not isinstance(block, dict):
        return []
    out: list[str] = []
    for key, value in block.items():
        if isinstance(value, dict):
            out.extend(_throttle(value))
        elif isinstance(value, str) and value.strip().lower() == "active" and key.lower() != "idle":
            out.append(key)
    return out


def _ecc_uncorrected(gpu: dict[str, Any]) -> int | None:
    volatile = gpu.get("ECC Errors", {})
    volatile = volatile.get("Volatile") if isinstance(volatile, dict) else None
    if not isinstance(volatile, dict):
        return None
    total: int | None = None
    for key, value in volatile.items():
        if isinstance(value, dict):  # older drivers: "Double Bit" -> "Total"
            if "double" in key.lower():
                v = _int(value, "Total")
                total = (total or 0) + v if v is not None else total
        elif "uncorrectable" in key.lower():
            v = _int(volatile, key)
            total = (total or 0) + v if v is not None else total
    return total


def _gpu(index: int, bus_id: str, gpu: dict[str, Any], driver: str, cuda: str) -> GPUReading:
    power = gpu.get("GPU Power Readings") or gpu.get("Power Readings") or {}
    pending_pages = _s(gpu, "Retired Pages", "Pending Page Blacklist") or _s(gpu, "Retired Pages", "Pending")
    return GPUReading(
        index=index,
        uuid=_s(gpu, "GPU UUID"),
        name=_s(gpu, "Product Name"),
        pci_bus_id=_s(gpu, "PCI", "Bus Id") or bus_id,
        memory_total_mb=_int(gpu, "FB Memory Usage", "Total"),
        memory_used_mb=_int(gpu, "FB Memory Usage", "Used"),
        driver_version=driver,
        cuda_version=cuda,
        utilization_percent=_int(gpu, "Utilization", "Gpu"),
        memory_utilization_percent=_int(gpu, "Utilization", "Memory"),
        temperature_c=_int(gpu, "Temperature", "GPU Current Temp"),
        memory_temperature_c=_int(gpu, "Temperature", "Memory Current Temp"),
        power_w=_num(power, "Power Draw") if isinstance(power, dict) else None,
        power_limit_w=(_num(power, "Current Power Limit") or _num(power, "Power Limit"))
        if isinstance(power, dict)
        else None,
        sm_clock_mhz=_int(gpu, "Clocks", "SM"),
        throttle=_throttle(gpu.get("Clocks Event Reasons") or gpu.get("Clocks Throttle Reasons")),
        ecc_uncorrected=_ecc_uncorrected(gpu),
        processes=_processes(gpu.get("Processes")),
        pcie_replays=_count(gpu, "PCI", "Replays Since Reset"),
        retired_pages_sbe=_count(gpu, "Retired Pages", "Single Bit ECC"),
        retired_pages_dbe=_count(gpu, "Retired Pages", "Double Bit ECC"),
        retire_pending=pending_pages.lower() == "yes",
        remapped_rows_correctable=_count(gpu, "Remapped Rows", "Correctable Error"),
        remapped_rows_uncorrectable=_count(gpu, "Remapped Rows", "Uncorrectable Error"),
        remap_pending=_yes(gpu, "Remapped Rows", "Pending"),
        remap_failure=_yes(gpu, "Remapped Rows", "Remapping Failure Occurred"),
        fabric=parse_fabric(gpu.get("Fabric")),
    )


def parse_query(text: str) -> SmiReport:
    """Every card of an `nvidia-smi -q` (or `-a`) output, indexed in the order listed."""
    report = SmiReport()
    header: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _GPU_HEADER.match(line)
        if m:
            blocks.append((m.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
        else:
            header.append(line)
    top = parse_tree(header)
    report.driver_version = version(top, "KMD Version", "Driver Version")
    report.cuda_version = version(top, "CUDA UMD Version", "CUDA Version")
    for i, (bus_id, lines) in enumerate(blocks):
        report.gpus.append(_gpu(i, bus_id, parse_tree(lines), report.driver_version, report.cuda_version))
    return report
