"""GPU health in the manner of NVIDIA's device plugin and DCGM.

XIDs are the driver's error reports. Some are the application's own fault
(an illegal address in a kernel, a graphics engine exception), and the card
is fine for the next process: the device plugin skips exactly 13, 31, 43, 45
and 68. Every other XID marks the card unhealthy, with what it means and
what the operator should do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The device plugin's list of XIDs that are the application's fault.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})

# What an XID means and what to do, from NVIDIA's XID catalogue (short forms).
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception (application fault)",
    31: "GPU memory page fault (application fault)",
    43: "GPU stopped processing (application fault)",
    45: "preemptive cleanup after a fault (application fault)",
    48: "double-bit ECC error: reset the GPU",
    61: "internal micro-controller breakpoint: reset the GPU",
    62: "internal micro-controller halt: reset the GPU",
    63: "ECC page retirement or row remap recorded: reset when idle",
    64: "row-remap failure: reset the GPU, then send it for service",
    68: "video processor exception (application fault)",
    74: "NVLink error: check the link, reset the GPU",
    79: "GPU has fallen off the bus: reboot the node",
    92: "high single-bit ECC error rate: watch the card",
    94: "contained ECC error: restart the application",
    95: "uncontained ECC error: reset the GPU",
    119: "GSP RPC timeout: reset the GPU",
    120: "GSP error: reset the GPU",
    140: "unrecovered ECC error: reset the GPU",
    145: "NVLink error: check the link, reset the GPU",
}

# DCGM's limit on retired pages before a card is to be replaced.
RETIRED_PAGES_LIMIT = 60
# DCGM's limit on PCIe replays per minute.
PCIE_REPLAYS_PER_MINUTE_LIMIT = 8


def xid_meaning(xid: int) -> str:
    """What an XID says, in a few words."""
    return XID_MEANINGS.get(xid, "GPU error: see NVIDIA's XID catalogue")


def xid_is_fatal(xid: int) -> bool:
    """Whether an XID leaves the card unhealthy (not an application's own fault)."""
    return xid not in APPLICATION_XIDS


@dataclass(frozen=True)
class KernelXid:
    """One XID line from the kernel log."""

    pci_bus_id: str
    xid: int
    text: str


_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), ?(.*)$")


def parse_kernel_xids(text: str) -> list[KernelXid]:
    """The XIDs the kernel log reports (`dmesg`), oldest first."""
    out: list[KernelXid] = []
    for line in text.splitlines():
        m = _XID_LINE.search(line)
        if m:
            out.append(KernelXid(pci_bus_id=m.group(1).lower(), xid=int(m.group(2)), text=m.group(3).strip()))
    return out


def same_pci(kernel_id: str, bus_id: str) -> bool:
    """Whether the kernel's short PCI id ("0000:18:00") names the card with bus id "00000000:18:00.0"."""
    k = kernel_id.lower().split(".")[0].split(":")
    b = bus_id.lower().split(".")[0].split(":")
    if len(k) < 3 or len(b) < 3:
        return False
    return int(k[0], 16) == int(b[0], 16) and k[1] == b[1] and k[2] == b[2]


def wear_problems(
    *,
    remap_failure: bool,
    remap_pending: bool,
    retire_pending: bool,
    retired_pages: int,
    replays_per_minute: float | None,
) -> list[str]:
    """The wear DCGM would flag, each a short sentence for the operator."""
    out: list[str] = []
    if remap_failure:
        out.append("row-remap failure: out of spare memory rows, reset then send for service")
    if remap_pending:
        out.append("memory rows remapped, waiting for a GPU reset")
    if retire_pending:
        out.append("memory pages waiting for a GPU reset to be retired")
    if retired_pages > RETIRED_PAGES_LIMIT:
        out.append(f"{retired_pages} retired pages, past the limit of {RETIRED_PAGES_LIMIT}: replace the card")
    if replays_per_minute is not None and replays_per_minute > PCIE_REPLAYS_PER_MINUTE_LIMIT:
        out.append(
            f"{replays_per_minute:.0f} PCIe replays a minute, past {PCIE_REPLAYS_PER_MINUTE_LIMIT}: "
            "check the slot and riser"
        )
    return out
