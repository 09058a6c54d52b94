"""Multi-node NVLink domains as racks: which trays are in, and what keeps the others out.

One function gathers it for the /admin/nvlink page and the /api/v1/nvlink
endpoint alike. A tray (a node) belongs to the rack of the domain its cards
report even when it is not in (a card still joining, IMEX down): those are
exactly the trays an operator has to see.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from inventory import gpus as gpu_rules
from inventory.models import GPU, Node, NodeState

# The rack for trays whose cards report an NVLink fabric but name no domain.
NO_DOMAIN = ""


class CardState:
    """How a card is drawn: lit, pulsing red, amber."""

    JOINED = "joined"
    NOT_JOINED = "not-joined"
    DEGRADED = "degraded"


class TrayState:
    """A tray as a whole: in the domain, in with reduced bandwidth, or out."""

    JOINED = "joined"
    DEGRADED = "degraded"
    OUT = "out"


@dataclass
class Card:
    """One GPU chip on a tray."""

    index: int
    state: str
    fabric_state: str
    fabric_status: str
    bandwidth: str
    uuid: str


@dataclass
class Tray:
    """One node of a rack, its cards, and why it is out (empty when it is in)."""

    node_id: str
    hostname: str
    node_state: str
    reachable: bool
    imex_state: str
    imex_channels: int
    imex_up: bool
    state: str
    cards: list[Card] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Machine:
    """A node whose NVSwitch is its own (an HGX box): NVLink inside it, no multi-node domain by design."""

    node_id: str
    hostname: str
    node_state: str
    gpus: int
    gpu_class: str


@dataclass
class Rack:
    """One NVLink domain ("" for trays whose cards name none)."""

    domain: str
    trays: list[Tray] = field(default_factory=list)

    @property
    def joined(self) -> int:
        """Trays fully in (degraded bandwidth still counts as in)."""
        return sum(1 for t in self.trays if t.state != TrayState.OUT)

    @property
    def cluster_uuid(self) -> str:
        """The fabric's cluster UUID, the domain without its clique."""
        return self.domain.split("/", 1)[0]

    @property
    def clique(self) -> str:
        """The clique within the cluster, "" when the driver gave none."""
        return self.domain.split("/", 1)[1] if "/" in self.domain else ""


def _candidate_domain(node: Node, cards: list[GPU]) -> str:
    """The domain a tray belongs to: its own, else the one most of its cards name."""
    if node.nvlink_domain:
        return node.nvlink_domain
    named = Counter(d for g in cards for d in [g.nvlink_domain] if d)
    if named:
        return sorted(named.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    # Cards still joining often already know their cluster: draw them in its rack.
    for g in cards:
        if gpu_rules.cluster_known(g.cluster_uuid):
            return gpu_rules.domain_name(g.cluster_uuid, g.clique_id)
    return NO_DOMAIN


def tray(node: Node, domain: str, cards: list[GPU]) -> Tray:
    """Draw one node as a tray of `domain`: each card's state and what keeps the tray out."""
    reasons: list[str] = []
    warnings: list[str] = []
    drawn: list[Card] = []
    for g in sorted(cards, key=lambda c: c.index):
        d = g.nvlink_domain
        if d and d == domain and gpu_rules.fabric_unhealthy(g.fabric_health):
            state = CardState.NOT_JOINED
            reasons.append(f"GPU {g.index} fabric health {g.fabric_health}")
        elif d and d == domain:
            degraded = gpu_rules.bandwidth_degraded(g.fabric_bandwidth)
            state = CardState.DEGRADED if degraded else CardState.JOINED
            if degraded:
                warnings.append(f"GPU {g.index} NVLink bandwidth degraded ({g.fabric_bandwidth})")
        else:
            state = CardState.NOT_JOINED
            if d:
                reasons.append(f"GPU {g.index} joined another domain ({d})")
            else:
                said = ", ".join(x for x in (g.fabric_state, g.fabric_status) if x) or "no fabric reported"
                reasons.append(f"GPU {g.index} not joined ({said})")
        drawn.append(Card(g.index, state, g.fabric_state, g.fabric_status, g.fabric_bandwidth, g.uuid))
    if not drawn:
        reasons.append("no GPUs reported")
    if not gpu_rules.imex_up(node.imex_state):
        reasons.append(f"IMEX down ({node.imex_state or 'not reported'})")
    elif node.imex_channels <= 0:
        reasons.append("no IMEX channel")
    if not node.reachable:
        reasons.append(f"node not ready ({node.state}, heartbeats missing)")
    elif node.state != NodeState.READY:
        reasons.append(f"node not ready ({node.state})")
    if reasons:
        state = TrayState.OUT
    elif warnings:
        state = TrayState.DEGRADED
    else:
        state = TrayState.JOINED
    return Tray(
        node_id=node.id,
        hostname=node.hostname,
        node_state=node.state,
        reachable=node.reachable,
        imex_state=node.imex_state,
        imex_channels=node.imex_channels,
        imex_up=gpu_rules.imex_up(node.imex_state),
        state=state,
        cards=drawn,
        reasons=reasons,
        warnings=warnings,
    )


def overview() -> tuple[list[Rack], list[Machine]]:
    """The multi-node racks and, apart from them, the single-node NVSwitch machines. Two queries.

    Racks: every NVLink domain as a rack of trays, domains in name order, the
    domainless rack last. Machines: nodes whose NVSwitch is their own (see
    gpu_rules.single_node_nvswitch), drawn neutral: they have nothing to
    join. Nodes whose cards report no NVLink fabric (PCIe cards) are in
    neither.
    """
    nodes = Node.objects.prefetch_related("gpus").order_by("id")
    by_domain: dict[str, Rack] = {}
    machines: list[Machine] = []
    for node in nodes:
        cards = list(node.gpus.all())
        if not any(gpu_rules.fabric_reported(g.fabric_state) for g in cards) and not node.nvlink_domain:
            continue
        if not node.nvlink_domain and gpu_rules.single_node_nvswitch(cards):
            classes = sorted({g.gpu_class for g in cards if g.gpu_class})
            machines.append(Machine(node.id, node.hostname, node.state, len(cards), ", ".join(classes)))
            continue
        domain = _candidate_domain(node, cards)
        rack = by_domain.setdefault(domain, Rack(domain))
        rack.trays.append(tray(node, domain, cards))
    for rack in by_domain.values():
        rack.trays.sort(key=lambda t: t.node_id)
    return sorted(by_domain.values(), key=lambda r: (r.domain == NO_DOMAIN, r.domain)), machines


def racks() -> list[Rack]:
    """Every multi-node NVLink domain as a rack of trays (see `overview`); single-node machines are not racks."""
    return overview()[0]
