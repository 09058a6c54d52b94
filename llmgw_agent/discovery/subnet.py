"""Subnet managers: the master a port sees (`sminfo`) and every SM on a fabric (`saquery -s`).

A fabric is named by its subnet managers, never by its GID prefix: OpenSM's
default fe80:: prefix is on every fabric and proves nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import llmgw_wire as wire

_SMINFO = re.compile(
    r"sminfo: sm lid (\S+) sm guid (0x[0-9A-Fa-f]+), activity count (\d+) priority (\d+)\s+state (\d+)\s*(\S*)",
    re.S,
)
_STATE_NAMES = {0: "NOTACTIVE", 1: "DISCOVERING", 2: "STANDBY", 3: "MASTER"}


def canonical_guid(guid: str) -> str:
    """A GUID as 0x and 16 lower-case hex digits; "" when it is not one."""
    g = (guid or "").strip().lower().removeprefix("0x").replace(":", "")
    try:
        return f"0x{int(g, 16):016x}"
    except ValueError:
        return ""


@dataclass(frozen=True)
class SMInfo:
    """The master subnet manager as one port sees it."""

    guid: str
    lid: int
    priority: int
    state: str
    activity: int


def parse_sminfo(text: str) -> SMInfo | None:
    """`sminfo` output; None when it names no subnet manager."""
    m = _SMINFO.search(" ".join(text.split()))
    if not m:
        return None
    lid = m.group(1)
    state = int(m.group(5))
    return SMInfo(
        guid=canonical_guid(m.group(2)),
        lid=int(lid, 16) if lid.lower().startswith("0x") else int(lid),
        priority=int(m.group(4)),
        state=m.group(6).removeprefix("SMINFO_") or _STATE_NAMES.get(state, str(state)),
        activity=int(m.group(3)),
    )


def _field(block: str, name: str) -> str:
    m = re.search(rf"^\s*{name}\.*\s*(\S+)", block, re.M)
    return m.group(1) if m else ""


def parse_saquery_sms(text: str) -> list[wire.SubnetManager]:
    """Every SMInfoRecord of `saquery -s`, master first, then by priority."""
    out: list[wire.SubnetManager] = []
    for block in text.split("SMInfoRecord dump:")[1:]:
        guid = canonical_guid(_field(block, "GUID") or _field(block, "SM_GUID"))
        if not guid:
            continue
        state_raw = _field(block, "SMState")
        state = _STATE_NAMES.get(int(state_raw), state_raw) if state_raw.isdigit() else state_raw
        lid = _field(block, "LID")
        prio = _field(block, "Priority")
        out.append(
            wire.SubnetManager(
                guid=guid,
                lid=int(lid, 0) if lid else 0,
                priority=int(prio) if prio.isdigit() else 0,
                state=state,
            )
        )
    out.sort(key=lambda s: (s.state != "MASTER", -s.priority, s.guid))
    return out
