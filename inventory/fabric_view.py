"""Physical fabrics as the operator's /admin/fabrics page shows them.

The cabling, not the declarations, decides what a fabric is: each port's key
(inventory.fabric.fabric_key over the telemetry cache's IB ports, with
canonical subnet managers) groups the nodes and ports; the declared names
from agent.yaml are then mapped onto those, and a declared fabric whose
adapters land on two keys is shown as a disagreement.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from inventory import fabric as fabric_rules
from inventory import scans, telemetry
from inventory.models import FabricAttachment, FabricScan, Node, SMChange


@dataclass
class PortRow:
    """One port on a fabric, with what the cache last said of it."""

    node_id: str
    hca: str
    port: int
    state: str
    rate_gbps: int
    link_layer: str
    sm_guid: str
    tx_bps: float
    rx_bps: float


@dataclass
class SMRow:
    """A subnet manager on a fabric."""

    guid: str
    lid: int
    priority: int
    state: str
    master: bool


@dataclass
class Disagreement:
    """A declared fabric whose adapters are cabled to more than one physical fabric."""

    node_id: str
    name: str
    hcas: list[str]
    keys: list[str]


@dataclass
class PhysicalFabricView:
    """Everything known of one physical fabric."""

    key: str
    kind: str
    declared: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    ports: list[PortRow] = field(default_factory=list)
    masters: list[SMRow] = field(default_factory=list)
    standbys: list[SMRow] = field(default_factory=list)
    sm_changes: list[SMChange] = field(default_factory=list)
    scan: FabricScan | None = None
    scan_age_s: float | None = None
    disagreements: list[Disagreement] = field(default_factory=list)


@dataclass
class FabricsPage:
    """The page: the fabrics, the disagreements, and declared fabrics no port confirms yet."""

    fabrics: list[PhysicalFabricView]
    disagreements: list[Disagreement]
    unconfirmed: list[tuple[str, str]]


# The most recent subnet-manager changes shown per fabric.
SM_CHANGES_PER_FABRIC = 20


def gather(*, now: dt.datetime) -> FabricsPage:
    """Gather the fabrics page from the telemetry cache and the inventory."""
    attachments = list(FabricAttachment.objects.order_by("node_id", "name"))
    # Every node, not only those declaring a fabric: an undeclared port is still on one.
    cached = telemetry.get_many(Node.objects.values_list("id", flat=True))
    entries_by_node = {node_id: scans.validated_ports(cached[node_id]) for node_id in sorted(cached)}
    ports_by_node = {node_id: [p for _, p in entries] for node_id, entries in entries_by_node.items()}
    canon = fabric_rules.canonical_sms(p for ports in ports_by_node.values() for p in ports)

    fabrics: dict[str, PhysicalFabricView] = {}
    for node_id, entries in entries_by_node.items():
        for raw, p in entries:
            key = fabric_rules.fabric_key(p, canon)
            if not key:
                continue
            f = fabrics.setdefault(key, PhysicalFabricView(key, key.split(":", 1)[0]))
            f.ports.append(
                PortRow(
                    node_id,
                    p.hca,
                    p.port,
                    p.state,
                    p.rate_gbps,
                    p.link_layer,
                    fabric_rules.canonical_guid(p.sm_guid),
                    float(raw.get("tx_bps") or 0),
                    float(raw.get("rx_bps") or 0),
                )
            )
            if node_id not in f.nodes:
                f.nodes.append(node_id)
            master = fabric_rules.canonical_guid(p.sm_guid)
            for sm in p.sms:
                guid = fabric_rules.canonical_guid(sm.guid)
                is_master = guid == master or sm.state.strip().upper() == "MASTER"
                row = SMRow(guid, sm.lid, sm.priority, sm.state, is_master)
                bucket = f.masters if is_master else f.standbys
                if all(r.guid != guid for r in f.masters + f.standbys):
                    bucket.append(row)
            if master and all(r.guid != master for r in f.masters):
                f.standbys = [r for r in f.standbys if r.guid != master]
                f.masters.append(SMRow(master, p.sm_lid, p.sm_priority, p.sm_state or "master", True))

    disagreements: list[Disagreement] = []
    unconfirmed: list[tuple[str, str]] = []
    for a in attachments:
        phys = fabric_rules.physical_fabric(a.hcas, ports_by_node.get(a.node_id, []), canon)
        if not phys.known:
            unconfirmed.append((a.node_id, a.name))
        elif not phys.consistent:
            d = Disagreement(a.node_id, a.name, list(a.hcas), list(phys.keys))
            disagreements.append(d)
            for k in phys.keys:
                if k in fabrics:
                    fabrics[k].disagreements.append(d)
        elif phys.key in fabrics and a.name not in fabrics[phys.key].declared:
            fabrics[phys.key].declared.append(a.name)

    # SM changes belong to the fabric their subnet managers name.
    sm_keys = {f"sm:{canon.get(g, g)}" for g in canon}
    recent = list(SMChange.objects.order_by("-at", "-id")[:500]) if sm_keys else []
    for change in recent:
        for guid in (change.to_guid, change.from_guid):
            g = fabric_rules.canonical_guid(guid)
            key = f"sm:{canon.get(g, g)}" if g else ""
            if key in fabrics:
                if len(fabrics[key].sm_changes) < SM_CHANGES_PER_FABRIC:
                    fabrics[key].sm_changes.append(change)
                break

    for scan in FabricScan.objects.filter(key__in=list(fabrics)):
        f = fabrics[scan.key]
        f.scan = scan
        f.scan_age_s = max(0.0, (now - scan.at).total_seconds())

    for f in fabrics.values():
        f.declared.sort()
        f.nodes.sort()
        f.ports.sort(key=lambda r: (r.node_id, r.hca, r.port))
    return FabricsPage(sorted(fabrics.values(), key=lambda f: f.key), disagreements, unconfirmed)
