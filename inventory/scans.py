"""Fabric scans: reading ibnetdiscover's map, and choosing who draws it next.

One port per physical fabric runs `ibnetdiscover` every few minutes (the
agent does the running; the control plane only asks). The map tells how many
switches and adapters the fabric has, and, more usefully, which of our own
adapters it does not show: a port that believes it is up on a fabric whose
map lacks it is cabled to something else, or sits behind a broken link.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction

import wire
from inventory import fabric as fabric_rules
from inventory import outbox, telemetry
from inventory.models import Command, CommandKind, Node, NodeState

# --- parsing ----------------------------------------------------------------

# A node's header: `Switch  36 "S-0008f10500200b50"  # "desc" enhanced port 0 lid 9 lmc 0`,
# `Ca  2 "H-0008f10403960984"  # "desc"`, `Rt ...` for routers.
_HEADER = re.compile(
    r'^(?P<kind>Switch|Ca|Rt)\s+(?P<ports>\d+)\s+"(?P<type>[SHR])-(?P<guid>[0-9A-Fa-fx]+)"(?P<rest>.*)$'
)
# A switch's port 0 GUID: `switchguid=0x8f10500200b50(8f10500200b50)`.
_SWITCHGUID = re.compile(r"^switchguid=(?P<guid>0x[0-9A-Fa-f]+)(?:\((?P<port>[0-9A-Fa-fx]+)\))?")
# A connectivity line: `[4]  "H-003048c749cd0000"[1](3048c749cd0001)  # ...` on a switch,
# `[1](78e7d103002297fd)  "S-0002c90200417670"[22]  # ...` on an adapter.
_LINK = re.compile(
    r"^\[(?P<port>\d+)\](?:\((?P<local>[0-9A-Fa-fx]+)\))?\s*"
    r'"(?P<ptype>[SHR])-(?P<pguid>[0-9A-Fa-fx]+)"\[(?P<pport>\d+)\](?:\((?P<pportguid>[0-9A-Fa-fx]+)\))?'
)
_DESC = re.compile(r'#\s*"(?P<desc>[^"]*)"')

_KIND = {"Switch": "switch", "Ca": "ca", "Rt": "router"}
# A SHARP aggregation node: the in-network reduction engine of a Quantum
# switch, which ibnetdiscover lists as a CA of its own (one per switch).
_AGGREGATION_NODE = "aggregation node"


@dataclass(frozen=True)
class ScanNode:
    """One node of a fabric map: a switch, an adapter (CA) or a router."""

    kind: str
    guid: str
    ports: int
    description: str
    port_guids: tuple[str, ...] = ()

    @property
    def aggregation_node(self) -> bool:
        """Whether this CA is a switch's SHARP aggregation node, not a host's adapter."""
        return self.kind == "ca" and _AGGREGATION_NODE in self.description.lower()


@dataclass(frozen=True)
class FabricMap:
    """What an ibnetdiscover text says: its nodes, and every node and port GUID it names."""

    nodes: tuple[ScanNode, ...] = ()
    node_guids: frozenset[str] = frozenset()
    port_guids: frozenset[str] = frozenset()
    links: int = 0
    # CAs the map lists with no port GUID line (a lone adapter seeing only
    # itself has no link to print one on): only their node GUID can match.
    portless_guids: frozenset[str] = frozenset()

    @property
    def switches(self) -> int:
        """How many switches the map shows."""
        return sum(1 for n in self.nodes if n.kind == "switch")

    @property
    def cas(self) -> int:
        """How many hosts' channel adapters (HCAs) the map shows, SHARP aggregation nodes left out."""
        return sum(1 for n in self.nodes if n.kind == "ca" and not n.aggregation_node)

    @property
    def aggregation_nodes(self) -> int:
        """How many SHARP aggregation nodes (one per Quantum switch with SHARP) the map shows."""
        return sum(1 for n in self.nodes if n.aggregation_node)

    @property
    def routers(self) -> int:
        """How many routers the map shows."""
        return sum(1 for n in self.nodes if n.kind == "router")

    def has_port(self, *, port_guid: str = "", node_guid: str = "") -> bool | None:
        """Whether the map shows an adapter's port: by its port GUID, else by its node GUID.

        A CA the map lists without any port GUID (a single adapter that sees
        only itself) is matched by its node GUID even when the port gives a
        port GUID: the map has nothing else to match it by. None when the port
        gives neither GUID, so nothing can be said.
        """
        pg = fabric_rules.canonical_guid(port_guid)
        ng = fabric_rules.canonical_guid(node_guid)
        if pg:
            return pg in self.port_guids or (bool(ng) and ng in self.portless_guids)
        if ng:
            return ng in self.node_guids
        return None


@dataclass
class _Building:
    kind: str
    guid: str
    ports: int
    description: str
    port_guids: list[str] = field(default_factory=list)


def _guid(raw: str | None) -> str:
    return fabric_rules.canonical_guid(raw or "")


# The last map read per fabric, by its text: a scan changes every few
# minutes, a scrape comes every few seconds and would parse it again.
_parsed: dict[str, tuple[str, FabricMap]] = {}


def fabric_map(key: str, text: str) -> FabricMap:
    """parse_ibnetdiscover(text), remembered per fabric key until the text changes (per process)."""
    hit = _parsed.get(key)
    if hit is not None and hit[0] == text:
        return hit[1]
    parsed = parse_ibnetdiscover(text)
    _parsed[key] = (text, parsed)
    return parsed


def parse_ibnetdiscover(text: str) -> FabricMap:
    """Read ibnetdiscover's default topology output.

    Lines it does not recognise (comments, `vendid=`, chassis headings, an
    `ibwarn:` on stderr mixed in) are skipped rather than refused: a partial
    map is still worth counting. Every GUID comes out in one spelling
    (inventory.fabric.canonical_guid) so it compares with what sysfs says.
    """
    nodes: list[_Building] = []
    node_guids: set[str] = set()
    port_guids: set[str] = set()
    links = 0
    pending_switch_port = ""
    current: _Building | None = None
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SWITCHGUID.match(line)
        if m:
            pending_switch_port = _guid(m.group("port") or m.group("guid"))
            continue
        m = _HEADER.match(line)
        if m:
            desc = _DESC.search(m.group("rest"))
            current = _Building(
                kind=_KIND[m.group("kind")],
                guid=_guid(m.group("guid")),
                ports=int(m.group("ports")),
                description=desc.group("desc") if desc else "",
            )
            if current.kind == "switch" and pending_switch_port:
                current.port_guids.append(pending_switch_port)
            pending_switch_port = ""
            nodes.append(current)
            node_guids.add(current.guid)
            port_guids.update(current.port_guids)
            continue
        m = _LINK.match(line)
        if m and current is not None:
            links += 1
            local = _guid(m.group("local"))
            if local:
                current.port_guids.append(local)
                port_guids.add(local)
            node_guids.add(_guid(m.group("pguid")))
            peer_port = _guid(m.group("pportguid"))
            if peer_port:
                port_guids.add(peer_port)
    built = tuple(
        ScanNode(kind=n.kind, guid=n.guid, ports=n.ports, description=n.description, port_guids=tuple(n.port_guids))
        for n in nodes
    )
    return FabricMap(
        nodes=built,
        node_guids=frozenset(node_guids),
        port_guids=frozenset(port_guids),
        links=links,
        portless_guids=frozenset(n.guid for n in built if n.kind == "ca" and not n.port_guids),
    )


# --- scheduling -------------------------------------------------------------


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
