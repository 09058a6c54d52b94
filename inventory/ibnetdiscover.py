"""Reading ibnetdiscover's map of a fabric.

The map tells how many switches and adapters the fabric has, and, more
usefully, which of our own adapters it does not show: a port that believes it
is up on a fabric whose map lacks it is cabled to something else, or sits
behind a broken link.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from inventory import fabric as fabric_rules

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
