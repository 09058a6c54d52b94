"""The snapshot every check reads: the inventory in a constant number of queries, plus the telemetry cache."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.core.cache import cache

from inventory import fabric as fabric_rules
from inventory import ibnetdiscover, scans, telemetry
from inventory.doctor import registry
from inventory.models import (
    GPU,
    EngineInstall,
    EngineInstallState,
    FabricAttachment,
    FabricScan,
    LivenessClock,
    Node,
    SMChange,
)

# A subnet-manager failover this recent is worth an operator's look.
SM_CHANGE_RECENT = dt.timedelta(hours=1)
_COUNTER_KEY = "doctor:ibctr:"


@dataclass(slots=True)
class GPURow:
    """The fields of a GPU row the checks and the metrics read (no model instance per card)."""

    index: int
    fabric_state: str
    fabric_status: str
    cluster_uuid: str
    clique_id: str
    fabric_bandwidth: str
    fabric_health: str
    ecc_errors: int
    problems: list[str]


@dataclass(slots=True)
class FabricRow:
    """A node's declared fabric as the checks read it."""

    name: str
    hcas: list[str]
    rate_gbps: int


# The node fields the checks and the metrics read; the others (labels, flags,
# engine versions: JSON decoded per row) are left in the database.
_NODE_FIELDS = ("id", "state", "unreachable_since", "last_seen", "imex_state", "imex_channels", "nvlink_domain")
_GPU_FIELDS = tuple(GPURow.__dataclass_fields__)
_FABRIC_FIELDS = tuple(FabricRow.__dataclass_fields__)


@dataclass
class Inventory:
    """Everything the checks read, taken at one moment."""

    now: dt.datetime
    nodes: list[Node]
    telemetry: dict[str, dict[str, Any]]
    scans: dict[str, FabricScan] = field(default_factory=dict)
    sm_changes: list[SMChange] = field(default_factory=list)
    failed_installs: list[EngineInstall] = field(default_factory=list)
    counter_baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_gpus: dict[str, list[GPURow]] = field(default_factory=dict)
    node_fabrics: dict[str, list[FabricRow]] = field(default_factory=dict)
    # The liveness sweep's view of the control plane's own faults (None before the first sweep).
    clock: LivenessClock | None = None
    # What the loaders of checks registered by other apps read, by their key
    # (placement's pending replicas): the inventory does not know their types.
    extra: dict[str, Any] = field(default_factory=dict)
    # Each fabric's parsed scan, by key, with what it was parsed from: the
    # kept doctor hands its own to every snapshot it checks, so a map is
    # parsed once per scan, not once per refresh.
    fabric_maps: dict[str, tuple[tuple, Any]] = field(default_factory=dict)
    _ports: dict[str, list[Any]] | None = None
    _canon: dict[str, str] | None = None

    def gpus(self, node_id: str) -> list[GPURow]:
        """A node's GPUs, by index."""
        return self.node_gpus.get(node_id, [])

    def fabrics(self, node_id: str) -> list[FabricRow]:
        """A node's declared fabrics, by name."""
        return self.node_fabrics.get(node_id, [])

    def ports(self, node_id: str) -> list[Any]:
        """A node's IB ports from its telemetry (scans.Port, or wire.IBPort for unusual entries)."""
        if self._ports is None:
            self._ports = {n: scans.ports_of(d) for n, d in self.telemetry.items()}
        return self._ports.get(node_id, [])

    def fabric_map(self, key: str, scan: FabricScan) -> ibnetdiscover.FabricMap:
        """The map a fabric's scan draws (parsed once per scan text)."""
        made_of = (scan.at, scan.output_at, len(scan.output))
        hit = self.fabric_maps.get(key)
        if hit is None or hit[0] != made_of:
            hit = self.fabric_maps[key] = (made_of, ibnetdiscover.fabric_map(key, scan.output))
        return hit[1]

    @property
    def canon(self) -> dict[str, str]:
        """Canonical subnet-manager names over every port heard of, computed once per snapshot."""
        if self._canon is None:
            self._canon = fabric_rules.canonical_sms(p for n in self.telemetry for p in self.ports(n))
        return self._canon


def _grouped(rows: Iterable[tuple], make: Callable[..., Any]) -> dict[str, list[Any]]:
    """Rows whose first column is a node id, made into objects and grouped by node, in row order."""
    out: dict[str, list[Any]] = {}
    for node_id, *rest in rows:
        out.setdefault(node_id, []).append(make(*rest))
    return out


def load_inventory(*, now: dt.datetime, checks: bool = True) -> Inventory:
    """Read what the checks need: seven queries, two cache round trips and what registered loaders read.

    Without `checks`, only what the metrics read besides the doctor's results:
    nodes, their GPUs and telemetry (two queries, one round trip).
    """
    nodes = list(Node.objects.only(*_NODE_FIELDS).order_by("id"))
    ids = [n.id for n in nodes]
    gpus = GPU.objects.order_by("node_id", "index").values_list("node_id", *_GPU_FIELDS)
    inv = Inventory(now=now, nodes=nodes, telemetry=telemetry.get_many(ids), node_gpus=_grouped(gpus, GPURow))
    if not checks:
        return inv
    fabrics = FabricAttachment.objects.order_by("node_id", "name").values_list("node_id", *_FABRIC_FIELDS)
    inv.node_fabrics = _grouped(fabrics, FabricRow)
    inv.counter_baselines = load_baselines(ids)
    load_fleet(inv)
    return inv


def load_fleet(inv: Inventory, *, scans: bool = True) -> None:
    """Read into `inv` what belongs to no one node (scans unless told not).

    The scans, recent failovers, failed installs, the liveness clock, and
    what the registered loaders read.
    """
    if scans:
        inv.scans = {s.key: s for s in FabricScan.objects.all()}
    inv.sm_changes = list(SMChange.objects.filter(at__gte=inv.now - SM_CHANGE_RECENT))
    inv.failed_installs = list(EngineInstall.objects.filter(state=EngineInstallState.FAILED).order_by("node_id"))
    inv.clock = LivenessClock.objects.filter(id=1).first()
    for load in registry.loaders():
        load(inv)


def load_nodes(*, now: dt.datetime, node_ids: Collection[str]) -> Inventory:
    """What the per-node checks read of these nodes alone (rows, GPUs, fabrics, telemetry, counter baselines).

    Four queries and two cache round trips however many; the rest of a full
    snapshot (scans, failovers, installs, the liveness clock, what other
    apps load) is the fleet's, and left empty.
    """
    ids = sorted(node_ids)
    nodes = list(Node.objects.only(*_NODE_FIELDS).filter(id__in=ids).order_by("id"))
    gpus = GPU.objects.filter(node_id__in=ids).order_by("node_id", "index").values_list("node_id", *_GPU_FIELDS)
    fabrics = (
        FabricAttachment.objects.filter(node_id__in=ids)
        .order_by("node_id", "name")
        .values_list("node_id", *_FABRIC_FIELDS)
    )
    present = [n.id for n in nodes]
    return Inventory(
        now=now,
        nodes=nodes,
        telemetry=telemetry.get_many(present),
        node_gpus=_grouped(gpus, GPURow),
        node_fabrics=_grouped(fabrics, FabricRow),
        counter_baselines=load_baselines(present),
    )


def counter_key(node_id: str) -> str:
    """The cache key of a node's counter baselines."""
    return _COUNTER_KEY + node_id


def load_baselines(node_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The IB counter baselines the cache holds for these nodes (see doctor/infiniband.py), by node."""
    found = telemetry.best_effort("doctor_baselines", lambda: cache.get_many([counter_key(n) for n in node_ids]), {})
    return {k[len(_COUNTER_KEY) :]: v for k, v in found.items()}
