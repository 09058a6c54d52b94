"""What the doctor reads of a node's telemetry, so a heartbeat can tell when that changed.

The doctor's incremental refresh (inventory/doctor/kept.py) re-checks only
the nodes the change feed names. Most of a heartbeat's telemetry moves every
time (rates, data counters, temperatures, the clocks) and none of that is the
doctor's business; what is: each IB port as the checks read it (state, rate,
identity, subnet manager, its error counters), each card's wear and problems,
and the clock skew as far as it shows in a finding. `view` is exactly that,
and the heartbeat marks the feed when it differs from the previous
heartbeat's (inventory/changes.py `mark_telemetry`).

This module imports nothing of the doctor's package: the heartbeat path
loads it, and the skew rule lives here so the check and the view share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import llmgw_wire as wire

# Clock skew between an agent and the control plane: a few seconds is noise,
# half a minute breaks liveness and makes log timelines lie.
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 30.0

ERROR_COUNTERS = tuple(wire.IB_ERROR_COUNTERS)
# What the checks read of a port (inventory/scans.py Port), besides its error counters. The heartbeat
# stores ports validated (wire.IBPort), so every counter is a count and a data counter tells nothing.
_PORT_READ = (
    "hca", "port", "state", "rate_gbps", "link_layer", "node_guid", "port_guid", "sm_guid", "sm_error", "network",
    "sms",
)  # fmt: skip


def skew(data: Mapping[str, Any]) -> tuple[str, bool] | None:
    """The clock-skew finding of one telemetry entry and whether it fails; None when within SKEW_WARN_S."""
    at, agent_at = data.get("at"), data.get("agent_at")
    if at is None or agent_at is None:
        return None
    s = float(agent_at) - float(at)
    if abs(s) <= SKEW_WARN_S:
        return None
    return f"agent clock {'ahead' if s > 0 else 'behind'} by {abs(s):.1f} s", abs(s) > SKEW_FAIL_S


def _port(p: Any) -> Any:
    # Built with map over bound methods: this runs twice a heartbeat for every port.
    if type(p) is not dict:
        return repr(p)
    counters = p.get("counters", {})
    errors = tuple(map(counters.get, ERROR_COUNTERS)) if type(counters) is dict else repr(counters)
    return *map(p.get, _PORT_READ), errors


def _sensor(g: Any) -> Any:
    if not isinstance(g, Mapping):
        return repr(g)
    return g.get("index"), g.get("wear"), g.get("problems")


def view(entry: Mapping[str, Any] | None) -> tuple:
    """What the doctor's checks read of a telemetry entry (equal views: equal findings)."""
    if not entry:
        return ()
    ports = entry.get("ib_ports") or []
    gpus = entry.get("gpus") or []
    return (
        True,
        skew(entry),
        [_port(p) for p in ports] if isinstance(ports, list) else repr(ports),
        [_sensor(g) for g in gpus] if isinstance(gpus, list) else repr(gpus),
    )
