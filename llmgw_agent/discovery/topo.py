"""`nvidia-smi topo -m`: each GPU's NUMA node, NVLink peers and path to each adapter.

NCCL pairs a GPU with the adapter it reaches through the fewest bridges;
the agent reports the same paths so the control plane can show a card's
nearest adapter and hand a shard the HCAs next to its GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\w+|mlx5_bond_\d+)$")
_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")
# Nearest first: one PCIe switch, several switches, the host bridge, the
# NUMA node's interconnect, across sockets.
PATH_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}


@dataclass
class GPUTopo:
    """One GPU's row of the matrix."""

    index: int
    cpu_affinity: str = ""
    numa_node: int | None = None
    nvlink_peers: list[int] = field(default_factory=list)
    nic_paths: dict[str, str] = field(default_factory=dict)


def nearest_nics(nic_paths: dict[str, str]) -> list[str]:
    """The adapters a GPU reaches over the shortest path (all of them on a tie)."""
    ranked = [(PATH_RANK.get(path, 9), nic) for nic, path in nic_paths.items()]
    if not ranked:
        return []
    best = min(r for r, _ in ranked)
    return sorted(nic for r, nic in ranked if r == best)


def parse_topo(text: str) -> dict[int, GPUTopo]:
    """Every GPU row of `nvidia-smi topo -m`, by GPU index; adapters named as the legend names them."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    legend: dict[str, str] = {}
    for line in lines:
        m = _LEGEND.match(line)
        if m:
            legend[m.group(1)] = m.group(2)
    columns: list[str] = []
    out: dict[int, GPUTopo] = {}
    for line in lines:
        tokens = line.split()
        if not tokens:
            continue
        if not columns:
            devices = [t for t in tokens if _DEVICE.match(t)]
            if devices and tokens[0] == devices[0] and tokens[: len(devices)] == devices:
                columns = devices
            continue
        name = tokens[0]
        if not name.startswith("GPU") or not name[3:].isdigit():
            continue
        index = int(name[3:])
        cells = tokens[1 : 1 + len(columns)]
        rest = tokens[1 + len(columns) :]
        topo = GPUTopo(index=index)
        for col, cell in zip(columns, cells, strict=False):
            if col.startswith("GPU"):
                if cell.startswith("NV"):
                    topo.nvlink_peers.append(int(col[3:]))
            elif cell != "X":
                topo.nic_paths[legend.get(col, col)] = cell
        if rest:
            topo.cpu_affinity = rest[0]
        if len(rest) > 1 and rest[1].lstrip("-").isdigit():
            topo.numa_node = int(rest[1])
        out[index] = topo
    return out
