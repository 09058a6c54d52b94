"""nvidia-imex: the domain status (`nvidia-imex-ctl -N`) and the channel devices.

Without IMEX up and a channel to open, a multi-node NVLink domain's GPUs
cannot map each other's memory, and NCCL's MNNVL fails at start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NODE = re.compile(r"^Node #(\d+)\s+-\s+(\S+)\s+-\s+(\S+)")
_DOMAIN = re.compile(r"^Domain State:\s*(\S+)", re.M)


@dataclass
class ImexStatus:
    """What `nvidia-imex-ctl -N` says of the domain."""

    domain_state: str = ""
    nodes: dict[str, str] = field(default_factory=dict)

    def detail(self) -> str:
        """One line for the operator: how many nodes are ready."""
        ready = sum(1 for s in self.nodes.values() if s == "READY")
        others = sorted(f"{addr} {s}" for addr, s in self.nodes.items() if s != "READY")
        text = f"{ready}/{len(self.nodes)} nodes ready"
        return text + ("; " + ", ".join(others) if others else "")


def parse_imex_ctl(text: str) -> ImexStatus:
    """The domain state and each node's state, from the formatted `-N` output."""
    status = ImexStatus()
    for line in text.splitlines():
        m = _NODE.match(line.strip())
        if m:
            status.nodes[m.group(2)] = m.group(3)
    m = _DOMAIN.search(text)
    if m:
        status.domain_state = m.group(1)
    return status


def count_channels(names: list[str]) -> int:
    """How many IMEX channel devices (channel0, channel1, ...) exist."""
    return sum(1 for n in names if re.fullmatch(r"channel\d+", n))
