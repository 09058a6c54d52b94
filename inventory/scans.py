"""Fabric scans: choosing which port draws each fabric's map next (the map itself: inventory/ibnetdiscover.py).

One port per physical fabric runs `ibnetdiscover` every few minutes (the
agent does the running; the control plane only asks). The map tells how many
switches and adapters the fabric has, and, more usefully, which of our own
adapters it does not show: a port that believes it is up on a fabric whose
map lacks it is cabled to something else, or sits behind a broken link.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction

import llmgw_wire as wire
from inventory import fabric as fabric_rules
from inventory import outbox, telemetry
from inventory.models import Command, CommandKind, Node, NodeState


@dataclass(frozen=True)
class ScanOrder:
    """The port chosen to scan one physical fabric."""

    key: str
    node_id: str
    hca: str
    port: int


# The fields a port's readers use, with their wire types. Telemetry holds
# what the heartbeat validated and dumped, so an entry of the right shape is
# read as it is; anything else goes through the wire model (or is skipped).
_PORT_STR = ("hca", "state", "link_layer", "node_guid", "port_guid", "sm_guid", "sm_error", "network")


class Port:
    """One IB port as telemetry holds it, read without re-validating it.

    Turning every port of a large cluster into a pydantic model on each
    /metrics scrape cost more than the rest of the doctor: 8,000 ports at
    1,000 nodes. The inventory.fabric rules take any object with these
    attributes, so a plain one is enough.
    """

    __slots__ = (*_PORT_STR, "port", "rate_gbps", "counters", "sms")

    hca: str
    port: int
    state: str
    link_layer: str
    rate_gbps: int
    counters: dict[str, int]
    node_guid: str
    port_guid: str
    sm_guid: str
    sm_error: str
    network: str
    sms: list[Any]

    def __init__(self, data: Mapping[str, Any]) -> None:
        get = data.get
        self.hca, self.port = data["hca"], data["port"]
        self.state, self.link_layer = get("state", ""), get("link_layer", "")
        self.rate_gbps, self.counters = get("rate_gbps", 0), get("counters", {})
        self.node_guid, self.port_guid = get("node_guid", ""), get("port_guid", "")
        self.sm_guid, self.sm_error, self.network = get("sm_guid", ""), get("sm_error", ""), get("network", "")
        self.sms = []


def _plain(data: Any) -> bool:
    """Whether a telemetry entry has the shape of a validated port dump (no subnet-manager list)."""
    if type(data) is not dict or data.get("sms"):
        return False
    if "hca" not in data:
        return False
    for name in _PORT_STR:
        value = data.get(name, "")
        if type(value) is not str or len(value) > (4096 if name == "sm_error" else 128):
            return False
    port, rate, counters = data.get("port"), data.get("rate_gbps", 0), data.get("counters", {})
    if type(port) is not int or not 0 <= port <= 255 or type(rate) is not int or not 0 <= rate <= 100_000:
        return False
    if type(counters) is not dict or len(counters) > 128:
        return False
    return all(type(k) is str and len(k) <= 128 and type(v) is int and 0 <= v < 2**63 for k, v in counters.items())


def ports_of(data: Mapping[str, Any] | None) -> list[Port | wire.IBPort]:
    """A node's IB ports from its telemetry (bad entries skipped).

    Entries shaped as the heartbeat stores them are read as `Port`s; the rest
    (a port listing its subnet managers, anything unexpected) are validated
    as wire.IBPort, as before.
    """
    out: list[Port | wire.IBPort] = []
    for p in (data or {}).get("ib_ports") or []:
        if _plain(p):
            out.append(Port(p))
        elif (port := _validated(p)) is not None:
            out.append(port)
    return out


def validated_ports(data: Mapping[str, Any] | None) -> list[tuple[Mapping[str, Any], wire.IBPort]]:
    """A node's IB ports from its telemetry, each validated as wire.IBPort beside its entry.

    The entry also carries what the heartbeat added (tx_bps, rx_bps). For the
    pages, which read every wire field; bad entries are skipped, so a
    malformed cache entry shows as nothing rather than a broken page.
    """
    return [(raw, port) for raw in (data or {}).get("ib_ports") or [] if (port := _validated(raw)) is not None]


def _validated(raw: Any) -> wire.IBPort | None:
    try:
        return wire.IBPort.model_validate(raw)
    except ValueError:
        return None


def plan_scans(
    states: Mapping[str, str], ports: Mapping[str, list[Any]], *, busy: Iterable[str] = ()
) -> list[ScanOrder]:
    """Pick one active port per InfiniBand fabric to run ibnetdiscover, skipping `busy` fabrics.

    `states` maps node id to state for the nodes that can receive a command
    (reachable ones); `ports` their IB ports. A ready node is preferred: a
    cordoned one still answers but is often cordoned for being sick. RoCE
    networks have no subnet manager to ask and are never scanned. Among equals
    the choice is stable (lowest node, adapter, port), so the same port keeps
    drawing the map and two maps compare.
    """
    every = [p for node_ports in ports.values() for p in node_ports]
    canon = fabric_rules.canonical_sms(every)
    skip = set(busy)
    best: dict[str, tuple[tuple, ScanOrder]] = {}
    for node_id, node_ports in ports.items():
        state = states.get(node_id)
        if state is None:
            continue
        for p in node_ports:
            key = fabric_rules.fabric_key(p, canon)
            if not key.startswith("sm:") or key in skip:
                continue
            rank = (state != NodeState.READY, node_id, p.hca, p.port)
            if key not in best or rank < best[key][0]:
                best[key] = (rank, ScanOrder(key=key, node_id=node_id, hca=p.hca, port=p.port))
    return [best[k][1] for k in sorted(best)]


def scan_pending_window() -> dt.timedelta:
    """How long an unacknowledged scan command keeps its fabric from getting another.

    One interval plus the scan's own timeout: an agent that is merely slow is
    not asked twice, one that never answered is asked again next round.
    """
    return dt.timedelta(seconds=settings.LLMGW_FABRIC_SCAN_INTERVAL + settings.LLMGW_FABRIC_SCAN_TIMEOUT)


def schedule_fabric_scans(*, now: dt.datetime) -> list[ScanOrder]:
    """Queue a ScanFabric for every InfiniBand fabric that has no recent one outstanding.

    A fabric whose last command went unacknowledged past the window gets a
    new one, and the old one is dropped: an agent that comes back should run
    one scan, not a backlog of them.
    """
    reachable = dict(
        Node.objects.filter(unreachable_since__isnull=True)
        .exclude(state__in=[NodeState.UNREACHABLE, NodeState.LOST])
        .values_list("id", "state")
    )
    found = telemetry.get_many(reachable)
    ports = {node_id: ports_of(data) for node_id, data in found.items()}
    since = now - scan_pending_window()
    outstanding = Command.objects.filter(kind=CommandKind.SCAN_FABRIC, acked_at__isnull=True)
    busy = {p.get("key", "") for p in outstanding.filter(created_at__gte=since).values_list("payload", flat=True)}
    orders = plan_scans(reachable, ports, busy=busy)
    with transaction.atomic():
        for order in orders:
            outstanding.filter(payload__key=order.key).delete()
            outbox.enqueue(
                order.node_id,
                wire.ScanFabric(
                    key=order.key, hca=order.hca, port=order.port, timeout_s=settings.LLMGW_FABRIC_SCAN_TIMEOUT
                ),
                now=now,
            )
    return orders


def port_label(hca: str, port: int | str) -> str:
    """How a port is named in scans and reports: "mlx5_0/1"."""
    return f"{hca}/{port}"
