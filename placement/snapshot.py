"""A planning snapshot: what the planner may know about the cluster, frozen at one moment.

The planner is a pure function over this (no database), so a dry run, a
benchmark and the reconciler all plan with the same code. The snapshot is
built (placement.snapshot_db) with a constant number of queries whatever the
size of the cluster; this module is its pure data, no Django: it is indexed by
GPU class and free-GPU count, by NVLink domain and by physical fabric, so that
finding a node does not scan every node.

Node records are frozen; `reserve` replaces a node's record with its new
usage and moves it between index buckets, so planning many replicas in a row
sees each earlier plan's claims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from placement.planner import Plan

ANY_CLASS = "*"
READY = "ready"

# A card's draw when nothing better is known, by model (its TDP, W). The
# power limit the agent reads from the card, when reported, wins.
GPU_TDP_W: dict[str, float] = {
    "GB300": 1400.0,
    "GB200": 1200.0,
    "B300": 1100.0,
    "B200": 1000.0,
    "H200": 700.0,
    "H100": 700.0,
    "H20": 400.0,
    "A100": 400.0,
    "L40S": 350.0,
    "L40": 300.0,
    "A10": 150.0,
    "L4": 72.0,
}
DEFAULT_GPU_TDP_W = 500.0
# A claimed CPU core's share of a node's draw.
CORE_W = 10.0

# `nvidia-smi topo -m` paths from a GPU to an adapter, nearest first.
PATH_RANK: dict[str, int] = {"NV": 6, "PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1}


def gpu_tdp_w(gpu_class: str) -> float:
    """The nominal draw of a card of this class (its model's TDP)."""
    model = (gpu_class or "").split("-")[0].upper()
    return GPU_TDP_W.get(model, DEFAULT_GPU_TDP_W)


@dataclass(frozen=True, slots=True)
class GPUInfo:
    """One card as the planner sees it."""

    index: int
    gpu_class: str
    healthy: bool = True
    numa: int = -1
    nvlink_peers: frozenset[int] = frozenset()
    # HCA -> topology path (PIX, PXB, PHB, NODE, SYS).
    nic_paths: Mapping[str, str] = field(default_factory=dict)
    # From telemetry; 0 when not reported.
    power_limit_w: float = 0.0

    def power_w(self) -> float:
        """The card's draw for power budgets: its power limit, else its class's TDP."""
        return self.power_limit_w or gpu_tdp_w(self.gpu_class)

    def hca_rank(self, hcas: Iterable[str]) -> int:
        """How near the nearest of these adapters is (higher is nearer, 0 unknown)."""
        return max((PATH_RANK.get(self.nic_paths.get(h, "").upper(), 0) for h in hcas), default=0)


@dataclass(frozen=True, slots=True)
class FabricInfo:
    """A node's declared fabric and where its adapters are really cabled."""

    name: str
    hcas: tuple[str, ...] = ()
    rate_gbps: int = 0
    # The physical fabric key (sm:..., roce:...), "" when unknown or inconsistent.
    key: str = ""
    known: bool = False
    consistent: bool = True
    keys: tuple[str, ...] = ()

    def problem(self) -> str:
        """Why this fabric cannot carry a multi-node replica, "" when it can."""
        if not self.consistent:
            return f"fabric {self.name} cabled to two physical fabrics ({', '.join(self.keys)})"
        if not self.known:
            return f"fabric {self.name}: no active adapter reports its physical fabric"
        return ""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as the planner sees it: what it is, and what is already claimed."""

    id: str
    state: str = READY
    mgmt_addr: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    # Why nothing new goes here ("held: rack=r12"), "" when not held.
    held: str = ""
    gpus: tuple[GPUInfo, ...] = ()
    free: frozenset[int] = frozenset()
    # Zero is "not reported", which constrains nothing.
    memory_total_gb: int = 0
    memory_claimed_gb: int = 0
    cpu_count: int = 0
    cpu_claimed: int = 0
    disk_free_bytes: int = 0
    disk_known: bool = False
    # None: the node did not look for weights, which constrains nothing.
    weights: frozenset[str] | None = None
    engines: frozenset[str] = frozenset()
    engines_probed: bool = False
    # engine -> why it cannot be installed here (unsupported, a failed install).
    engines_blocked: Mapping[str, str] = field(default_factory=dict)
    # The NVLink domain every card is joined to ("" none) and whether IMEX is up.
    nvlink_domain: str = ""
    imex_up: bool = False
    # Why the node is out of the NVLink domain its cards name ("GPU 2 fabric health Unhealthy"), "" when not.
    nvlink_out: str = ""
    fabrics: tuple[FabricInfo, ...] = ()
    # Momentary draw from telemetry (W), for the operator; budgets count claims.
    power_draw_w: float = 0.0
    ports: frozenset[int] = frozenset()
    # TCP ports the node's agent reports listening (its own shards' among them): a shard
    # port handed out here would die with "Address already in use".
    busy_ports: frozenset[int] = frozenset()
    # Seconds since the last heartbeat when past LLMGW_UNREACHABLE_AFTER (0: the lease holds).
    # The planner refuses such a node whatever its state says: the sweep may not have run yet.
    silent_s: int = 0

    @property
    def schedulable(self) -> bool:
        """Ready, heard from within the lease, and not held."""
        return self.state == READY and not self.held and not self.silent_s

    def gpu_classes(self) -> set[str]:
        """The classes of this node's cards."""
        return {g.gpu_class for g in self.gpus}

    def free_gpus(self, gpu_class: str = "") -> list[GPUInfo]:
        """The free healthy cards, of one class when given, by index."""
        return [
            g for g in self.gpus if g.index in self.free and (not gpu_class or gpu_class in (ANY_CLASS, g.gpu_class))
        ]

    def free_count(self, gpu_class: str = "") -> int:
        """How many free healthy cards (of a class)."""
        if not gpu_class or gpu_class == ANY_CLASS:
            return len(self.free)
        return sum(1 for g in self.gpus if g.index in self.free and g.gpu_class == gpu_class)

    def domain_ready(self) -> bool:
        """Whether a multi-node replica may use this node's NVLink domain: every card joined, IMEX up."""
        return bool(self.nvlink_domain) and self.imex_up

    def fabric_for(self, key: str) -> FabricInfo | None:
        """The declared fabric cabled to this physical fabric, if any."""
        for f in self.fabrics:
            if f.consistent and f.known and f.key == key:
                return f
        return None

    def groups(self) -> list[str]:
        """The index groups this node is found in: all, its domain, its physical fabrics."""
        out = [""]
        if self.domain_ready():
            out.append("nvl:" + self.nvlink_domain)
        for f in self.fabrics:
            if f.consistent and f.known:
                out.append("fab:" + f.key)
        return out


@dataclass(frozen=True, slots=True)
class HoldInfo:
    """A facility hold, as the planner matches it."""

    scope: str
    node_id: str = ""
    label_key: str = ""
    label_value: str = ""
    fabric: str = ""

    def text(self) -> str:
        """The reason a held node shows."""
        if self.scope == "node":
            return "held: node"
        if self.scope == "label":
            return f"held: {self.label_key}={self.label_value}"
        return f"held: fabric {self.fabric}"

    def matches(self, node_id: str, labels: Mapping[str, str], fabrics: Iterable[FabricInfo]) -> bool:
        """Whether this hold covers a node."""
        if self.scope == "node":
            return self.node_id == node_id
        if self.scope == "label":
            return labels.get(self.label_key) == self.label_value
        return any(self.fabric in (f.name, f.key) for f in fabrics)


@dataclass(frozen=True)
class Snapshot:
    """The cluster for planning. Nodes are frozen records; `reserve` swaps in updated ones."""

    nodes: dict[str, NodeInfo]
    # (label key, label value) -> budget and claimed power (W).
    budgets: dict[tuple[str, str], float] = field(default_factory=dict)
    budget_used: dict[tuple[str, str], float] = field(default_factory=dict)
    port_base: int = 18000
    # Ports in use anywhere, when shard ports must be unique across the
    # cluster; None: per host.
    cluster_ports: set[int] | None = None
    # Management address -> ports in use by the shards of every node at it.
    # Nodes at one address are one host (a simulated fleet, `make demo`):
    # counting each node's ports from the same base, their shards collided
    # ("Address already in use") and were placed again every few seconds.
    host_ports: dict[str, set[int]] = field(default_factory=dict)
    # (gpu class or "*", group) -> free-GPU count -> node ids, sorted; schedulable nodes only.
    _index: dict[tuple[str, str], dict[int, SortedList]] = field(default_factory=dict, repr=False)
    _budget_keys: frozenset[str] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_budget_keys", frozenset(k for k, _ in self.budgets))
        for n in self.nodes.values():
            self._add(n)
            if n.mgmt_addr:
                self.host_ports.setdefault(n.mgmt_addr, set()).update(n.ports | n.busy_ports)

    # The index ---------------------------------------------------------
    def _slots(self, n: NodeInfo) -> Iterator[tuple[tuple[str, str], int]]:
        if not n.schedulable:
            return
        classes = {ANY_CLASS, *n.gpu_classes()}
        for group in n.groups():
            for c in classes:
                yield (c, group), n.free_count(c)

    def _add(self, n: NodeInfo) -> None:
        for slot, count in self._slots(n):
            buckets = self._index.setdefault(slot, {})
            lst = buckets.get(count)
            if lst is None:
                lst = buckets[count] = SortedList()
            lst.add(n.id)

    def _remove(self, n: NodeInfo) -> None:
        for slot, count in self._slots(n):
            self._index[slot][count].discard(n.id)

    def candidates(self, gpu_class: str, group: str, need: int, *, spread: bool) -> Iterator[NodeInfo]:
        """Schedulable nodes of a group with at least `need` free cards of a class.

        Binpack order (fewest free first) or spread order (most free first),
        then by node id, so the same cluster always gives the same answer.
        """
        buckets = self._index.get((gpu_class or ANY_CLASS, group))
        if not buckets:
            return
        counts = sorted((c for c in buckets if c >= need), reverse=spread)
        for c in counts:
            # A copy: the caller may reserve while iterating.
            for node_id in list(buckets[c]):
                yield self.nodes[node_id]

    def groups(self, prefix: str) -> list[str]:
        """The NVLink domain ("nvl:") or physical fabric ("fab:") groups present, sorted."""
        return sorted({g for (_, g) in self._index if g.startswith(prefix)})

    # Power -----------------------------------------------------------
    def budget_keys_of(self, n: NodeInfo) -> list[tuple[str, str]]:
        """The budgets a node's draw counts against."""
        out = []
        for k in self._budget_keys:
            v = n.labels.get(k)
            if v is not None and (k, v) in self.budgets:
                out.append((k, v))
        return sorted(out)

    # Claims ----------------------------------------------------------
    def replace(self, n: NodeInfo) -> None:
        """Swap in a node's new record, keeping the index right."""
        old = self.nodes.get(n.id)
        if old is not None:
            self._remove(old)
        self.nodes[n.id] = n
        self._add(n)

    def reserve(self, plan: Plan) -> None:
        """Count a plan's claims, so the next plan in the same pass sees them."""
        for s in plan.shards:
            n = self.nodes[s.node_id]
            bound = s.ports()
            ports = set(n.ports) | set(bound)
            if self.cluster_ports is not None:
                self.cluster_ports.update(bound)
            if n.mgmt_addr:
                self.host_ports.setdefault(n.mgmt_addr, set()).update(bound)
            self.replace(
                dataclasses.replace(
                    n,
                    free=n.free - set(s.gpu_indices),
                    memory_claimed_gb=n.memory_claimed_gb + s.memory_gb,
                    cpu_claimed=n.cpu_claimed + s.cpu_cores,
                    ports=frozenset(ports),
                )
            )
            self.claim_power(n, s.power_w)

    def claim_power(self, n: NodeInfo, watts: float) -> None:
        """Count a draw on a node against every budget it falls under."""
        for bk in self.budget_keys_of(n):
            self.budget_used[bk] = self.budget_used.get(bk, 0.0) + watts

    def free_port(self, n: NodeInfo, *, skip: Iterable[int] = (), span: int = 1) -> int:
        """The lowest port from the base that starts `span` ports no shard on the node's host uses.

        The host is the node's management address; a shard binding ports after
        its HTTP port (SGLang's data parallelism) needs them all free. A port
        the node (or another at its address) reports listening is never free.
        """
        used = set(n.ports) | n.busy_ports | set(skip)
        if n.mgmt_addr:
            used |= self.host_ports.get(n.mgmt_addr, set())
        if self.cluster_ports is not None:
            used |= self.cluster_ports
        p = self.port_base
        while any(q in used for q in range(p, p + span)):
            p += 1
        return p
