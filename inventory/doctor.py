"""The doctor: checks that tell an operator something is wrong before a job hangs.

Each check is a plain function over an `Inventory` (a snapshot read in a
constant number of queries, plus the telemetry cache) and answers pass, warn
or fail, the nodes it concerns, what it found and what to do. `manage.py
doctor`, `GET /api/v1/doctor` and the `llmgw_doctor_checks` metric all run
`run_checks` on the same snapshot; the last two reuse a run for
settings.LLMGW_DOCTOR_CACHE seconds (`latest`), so what they show can be
that old, and the report's `at` says when it ran.

Error counters: a counter's absolute value says little (a port up for a year
has some symbol errors); a counter that rises does. The doctor keeps, per
node, two generations of counter baselines in the cache ("doctor:ibctr:<node>"),
rolled every `COUNTER_WINDOW`: the current values are compared with the
older one, so a rise stays visible for one to two windows whoever runs the
doctor and however often, and a counter that fell (a reset) is not a rise.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from django.conf import settings
from django.core.cache import cache

import wire
from inventory import fabric as fabric_rules
from inventory import gpus as gpu_rules
from inventory import scans, telemetry
from inventory.models import (
    GPU,
    EngineInstall,
    EngineInstallState,
    FabricAttachment,
    FabricScan,
    LivenessClock,
    Node,
    NodeState,
    SMChange,
)

# Clock skew between an agent and the control plane: a few seconds is noise,
# half a minute breaks liveness and makes log timelines lie.
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 30.0
# A subnet-manager failover this recent is worth an operator's look.
SM_CHANGE_RECENT = dt.timedelta(hours=1)
# How long one generation of counter baselines lasts (see the module docstring).
COUNTER_WINDOW = dt.timedelta(minutes=10)
_COUNTER_KEY = "doctor:ibctr:"
_COUNTER_TTL_S = 24 * 3600

ERROR_COUNTERS = wire.IB_ERROR_COUNTERS
FAIL_COUNTERS = frozenset({"link_downed"})


class Result(StrEnum):
    """A check's verdict."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


_SEVERITY = {Result.PASS: 0, Result.WARN: 1, Result.FAIL: 2}


@dataclass
class CheckResult:
    """One check's answer: its verdict, the nodes it concerns, what it found and what to do."""

    name: str
    result: Result
    summary: str
    action: str = ""
    nodes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-able data."""
        d = asdict(self)
        d["result"] = str(self.result)
        return d


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
    pending_replicas: list[Any] = field(default_factory=list)
    counter_baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_gpus: dict[str, list[GPURow]] = field(default_factory=dict)
    node_fabrics: dict[str, list[FabricRow]] = field(default_factory=dict)
    # The liveness sweep's view of the control plane's own faults (None before the first sweep).
    clock: LivenessClock | None = None
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
    """Read what the checks need: eight queries and two cache round trips, whatever the cluster's size.

    Without `checks`, only what the metrics read besides the doctor's results:
    nodes, their GPUs and telemetry (two queries, one round trip).
    """
    from placement.models import Replica, ReplicaState

    nodes = list(Node.objects.only(*_NODE_FIELDS).order_by("id"))
    ids = [n.id for n in nodes]
    gpus = GPU.objects.order_by("node_id", "index").values_list("node_id", *_GPU_FIELDS)
    inv = Inventory(now=now, nodes=nodes, telemetry=telemetry.get_many(ids), node_gpus=_grouped(gpus, GPURow))
    if not checks:
        return inv
    fabrics = FabricAttachment.objects.order_by("node_id", "name").values_list("node_id", *_FABRIC_FIELDS)
    inv.node_fabrics = _grouped(fabrics, FabricRow)
    inv.scans = {s.key: s for s in FabricScan.objects.all()}
    inv.sm_changes = list(SMChange.objects.filter(at__gte=now - SM_CHANGE_RECENT))
    inv.failed_installs = list(EngineInstall.objects.filter(state=EngineInstallState.FAILED).order_by("node_id"))
    inv.pending_replicas = list(
        Replica.objects.filter(state=ReplicaState.PENDING).select_related("deployment").order_by("created_at")
    )
    inv.counter_baselines = _load_baselines(ids)
    inv.clock = LivenessClock.objects.filter(id=1).first()
    return inv


def _verdict(name: str, found: dict[str, list[str]], *, fails: set[str], ok: str, bad: str, action: str) -> CheckResult:
    """Build a result from per-node findings; nodes in `fails` make it a failure, others a warning."""
    if not found:
        return CheckResult(name, Result.PASS, ok)
    result = Result.FAIL if fails & set(found) else Result.WARN
    nodes = sorted(found)
    details = [f"{n}: {d}" for n in nodes for d in found[n]]
    return CheckResult(name, result, bad.format(n=len(nodes)), action, nodes, details)


# --- nodes ------------------------------------------------------------------


def check_nodes_reachable(inv: Inventory) -> CheckResult:
    """Nodes whose heartbeats stopped: unreachable is a warning, lost a failure."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    for n in inv.nodes:
        if n.state == NodeState.LOST:
            found[n.id] = ["lost: its replicas were declared dead"]
            fails.add(n.id)
        elif n.state == NodeState.UNREACHABLE or n.unreachable_since is not None:
            since = n.unreachable_since or n.last_seen
            found[n.id] = [f"no heartbeat since {since:%Y-%m-%d %H:%M:%S}" if since else "no heartbeat"]
    return _verdict(
        "nodes_reachable",
        found,
        fails=fails,
        ok="every node is heartbeating",
        bad="{n} node(s) not heartbeating",
        action="check the agent service and the management network on these nodes; a lost node's replicas "
        "are rebuilt elsewhere, and it returns to ready by itself when heartbeats resume",
    )


# How long a blind window of the liveness sweep stays a warning after it ended.
BLIND_RECENT = dt.timedelta(hours=1)


def check_control_plane_liveness(inv: Inventory) -> CheckResult:
    """Whether the liveness sweep could listen: mass silence now fails, a recent blind window warns."""
    name = "control_plane_liveness"
    clock = inv.clock
    if clock is not None and clock.disruption_since is not None:
        return CheckResult(
            name,
            Result.FAIL,
            f"{clock.disruption_detail} since {clock.disruption_since:%Y-%m-%d %H:%M:%S}: read as the control "
            "plane's own outage; no node is marked unreachable or lost until heartbeats resume",
            "check the web servers, the load balancer, the cache and the network between the agents and the "
            "control plane; if those nodes are really down (a rack lost power), raise LLMGW_MASS_SILENCE or "
            "cordon them so their replicas can be rebuilt elsewhere",
        )
    if (
        clock is not None
        and clock.blind_until is not None
        and clock.blind_reason != "first sweep"
        and inv.now - clock.blind_until < BLIND_RECENT
    ):
        return CheckResult(
            name,
            Result.WARN,
            f"the liveness sweep could not listen from {clock.blind_from:%Y-%m-%d %H:%M:%S} to "
            f"{clock.blind_until:%Y-%m-%d %H:%M:%S} ({clock.blind_reason}); that silence was not held against "
            "any node",
            "check the database, the Celery worker and beat, and the web tier for that period",
        )
    if clock is None or clock.last_sweep_at is None:
        return CheckResult(name, Result.PASS, "no liveness sweep recorded yet")
    idle = (inv.now - clock.last_sweep_at).total_seconds()
    if idle > settings.LLMGW_SWEEP_GAP:
        return CheckResult(
            name,
            Result.WARN,
            f"no liveness sweep for {int(idle)} s: silent nodes are not being judged",
            "check Celery beat and the worker (make run starts both)",
        )
    return CheckResult(name, Result.PASS, "the liveness sweep runs and hears the fleet")


def check_clock_skew(inv: Inventory) -> CheckResult:
    """The agent's clock against the control plane's, read from the latest heartbeat."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    for node_id, data in sorted(inv.telemetry.items()):
        at, agent_at = data.get("at"), data.get("agent_at")
        if at is None or agent_at is None:
            continue
        skew = float(agent_at) - float(at)
        if abs(skew) > SKEW_WARN_S:
            found[node_id] = [f"agent clock {'ahead' if skew > 0 else 'behind'} by {abs(skew):.1f} s"]
            if abs(skew) > SKEW_FAIL_S:
                fails.add(node_id)
    return _verdict(
        "clock_skew",
        found,
        fails=fails,
        ok=f"every agent's clock is within {SKEW_WARN_S:g} s",
        bad="{n} node(s) with a skewed clock",
        action="enable time synchronisation (chrony or systemd-timesyncd) on these nodes against the "
        "control plane's time source",
    )


# --- NVLink -----------------------------------------------------------------


def _has_nvlink_fabric(gpus: Iterable[Any]) -> bool:
    """Whether a node takes part in a multi-node NVLink fabric (or tries to).

    A lone machine's NVSwitch reports a completed fabric with a cluster UUID
    of zeros; that is no domain, and its cards are not "unjoined".
    """
    for g in gpus:
        if gpu_rules.fabric_joined(g.fabric_state, g.fabric_status, g.cluster_uuid):
            return True
        if gpu_rules.fabric_reported(g.fabric_state) and g.fabric_state.strip().lower() != "completed":
            return True
    return False


def check_nvlink_joined(inv: Inventory) -> CheckResult:
    """Cards not joined to the NVLink fabric on a node that has one."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        gpus = list(inv.gpus(n.id))
        if not _has_nvlink_fabric(gpus):
            continue
        for g in gpus:
            if not gpu_rules.fabric_joined(g.fabric_state, g.fabric_status, g.cluster_uuid):
                state = g.fabric_state or "no state"
                status = f", {g.fabric_status}" if g.fabric_status else ""
                found.setdefault(n.id, []).append(f"GPU {g.index} not joined ({state}{status})")
    return _verdict(
        "nvlink_joined",
        found,
        fails=set(found),
        ok="every card of every NVLink node is joined",
        bad="{n} node(s) with cards not joined to their NVLink fabric",
        action="check nvidia-fabricmanager on the node and the tray's NVLink cabling; restarting the fabric "
        "manager drops every card, so drain the node first",
    )


def check_nvlink_bandwidth(inv: Inventory) -> CheckResult:
    """Joined cards that report less than their full NVLink bandwidth."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        for g in inv.gpus(n.id):
            joined = gpu_rules.fabric_joined(g.fabric_state, g.fabric_status, g.cluster_uuid)
            if joined and gpu_rules.bandwidth_degraded(g.fabric_bandwidth):
                found.setdefault(n.id, []).append(f"GPU {g.index} NVLink bandwidth {g.fabric_bandwidth}")
    return _verdict(
        "nvlink_bandwidth",
        found,
        fails=set(),
        ok="no degraded NVLink bandwidth",
        bad="{n} node(s) with degraded NVLink bandwidth",
        action="a card with degraded links slows every collective it is in: check the NVLink cables or "
        "trays and the NVLink error counters (nvidia-smi nvlink -e)",
    )


def check_nvlink_health(inv: Inventory) -> CheckResult:
    """Cards whose driver says their NVLink fabric is unhealthy or of limited capacity."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        for g in inv.gpus(n.id):
            if gpu_rules.fabric_unhealthy(g.fabric_health):
                found.setdefault(n.id, []).append(
                    f"GPU {g.index} NVLink fabric health {g.fabric_health}: the node is kept out of multi-node "
                    "NVLink placement"
                )
    return _verdict(
        "nvlink_health",
        found,
        fails=set(found),
        ok="no card reports an unhealthy NVLink fabric",
        bad="{n} node(s) with a card whose NVLink fabric is unhealthy",
        action="read `nvidia-smi -q` Fabric > Health on the card (Incorrect Configuration, Route Unhealthy, "
        "Partition Assigned say why) and the fabric manager's log; drain the node before restarting the "
        "fabric manager, which drops every card",
    )


def check_nvlink_domains(inv: Inventory) -> CheckResult:
    """A node whose cards are joined to two different NVLink domains."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        domains = sorted(
            {
                d
                for g in inv.gpus(n.id)
                for d in [gpu_rules.gpu_domain(g.fabric_state, g.fabric_status, g.cluster_uuid, g.clique_id)]
                if d
            }
        )
        if len(domains) > 1:
            found[n.id] = [f"cards in {len(domains)} domains: {', '.join(domains)}"]
    return _verdict(
        "nvlink_domains",
        found,
        fails=set(found),
        ok="no node is split between NVLink domains",
        bad="{n} node(s) with cards in two NVLink domains",
        action="the tray is cabled or configured into two NVLink partitions; fix the partition in the "
        "fabric manager (or the cabling) so every card of a node is in one domain",
    )


def check_imex(inv: Inventory) -> CheckResult:
    """IMEX down, or without a channel, on a node that is in an NVLink domain."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        in_domain = bool(n.nvlink_domain) or bool(gpu_rules.node_domain(inv.gpus(n.id)))
        if not in_domain:
            continue
        if not n.imex_up():
            found[n.id] = [f"IMEX {n.imex_state or 'not reported'}"]
        elif n.imex_channels <= 0:
            found[n.id] = ["IMEX up without a channel"]
    return _verdict(
        "imex",
        found,
        fails=set(found),
        ok="IMEX is up with a channel on every node in an NVLink domain",
        bad="{n} node(s) in an NVLink domain without working IMEX",
        action="start nvidia-imex (systemctl start nvidia-imex) with every domain member in its nodes_config, "
        "and create a channel (/dev/nvidia-caps-imex-channels/channel0); without it the domain's GPUs "
        "cannot share memory across nodes",
    )


# --- InfiniBand -------------------------------------------------------------


def check_ib_physical_fabric(inv: Inventory) -> CheckResult:
    """A declared fabric whose adapters are cabled to two physical fabrics."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        ports = inv.ports(n.id)
        for f in inv.fabrics(n.id):
            pf = fabric_rules.physical_fabric(f.hcas, ports, inv.canon)
            if pf.known and not pf.consistent:
                found.setdefault(n.id, []).append(f"fabric {f.name}: adapters on {', '.join(pf.keys)}")
    return _verdict(
        "ib_physical_fabric",
        found,
        fails=set(found),
        ok="every declared fabric sits on one physical fabric",
        bad="{n} node(s) with a declared fabric cabled to two physical fabrics",
        action="fix the cabling or the node's agent.yaml (fabrics: name, hcas): NCCL handed adapters on "
        "two fabrics hangs instead of failing; the planner avoids such nodes meanwhile",
    )


def check_ib_ports(inv: Inventory) -> CheckResult:
    """Ports of a declared fabric that are not active, or slower than the declared rate."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    for n in inv.nodes:
        by_hca: dict[str, list[Any]] = {}
        for p in inv.ports(n.id):
            by_hca.setdefault(p.hca, []).append(p)
        for f in inv.fabrics(n.id):
            for hca in f.hcas:
                for p in by_hca.get(hca, []):
                    label = scans.port_label(p.hca, p.port)
                    if not fabric_rules.port_active(p):
                        found.setdefault(n.id, []).append(f"{label} ({f.name}) is {p.state or 'down'}")
                        fails.add(n.id)
                    elif f.rate_gbps and p.rate_gbps and p.rate_gbps < f.rate_gbps:
                        found.setdefault(n.id, []).append(
                            f"{label} ({f.name}) at {p.rate_gbps} Gb/s, declared {f.rate_gbps} Gb/s"
                        )
    return _verdict(
        "ib_ports",
        found,
        fails=fails,
        ok="every declared port is active at its declared rate",
        bad="{n} node(s) with ports down or slow",
        action="check the cable and the switch port (ibstat, ibportstate); a port that trains below its rate "
        "usually has a bad cable or transceiver",
    )


def check_ib_subnet_manager(inv: Inventory) -> CheckResult:
    """InfiniBand ports that see no master subnet manager, and recent SM failovers."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    for n in inv.nodes:
        for p in inv.ports(n.id):
            if fabric_rules.port_active(p) and not fabric_rules.port_is_roce(p) and not p.sm_guid:
                why = f": {p.sm_error}" if p.sm_error else ""
                found.setdefault(n.id, []).append(f"{scans.port_label(p.hca, p.port)} sees no master SM{why}")
                fails.add(n.id)
    for c in inv.sm_changes:
        found.setdefault(c.node_id, []).append(
            f"{c.port} master SM {c.from_guid or '?'} -> {c.to_guid or '?'} at {c.at:%Y-%m-%d %H:%M:%S}"
        )
    return _verdict(
        "ib_subnet_manager",
        found,
        fails=fails,
        ok="every InfiniBand port sees a master subnet manager, and none failed over in the last hour",
        bad="{n} node(s) with subnet-manager trouble",
        action="with no master SM the fabric cannot route new paths: start opensm (or the switch's SM) on "
        "a standby; after a failover, find why the old master went (sminfo, the SM's log)",
    )


def _counter_snapshot(ports: list[Any]) -> dict[str, dict[str, int]]:
    return {
        scans.port_label(p.hca, p.port): {c: int(p.counters[c]) for c in ERROR_COUNTERS if c in p.counters}
        for p in ports
    }


def counter_key(node_id: str) -> str:
    """The cache key of a node's counter baselines."""
    return _COUNTER_KEY + node_id


def _load_baselines(node_ids: list[str]) -> dict[str, dict[str, Any]]:
    found = telemetry.best_effort("doctor_baselines", lambda: cache.get_many([counter_key(n) for n in node_ids]), {})
    return {k[len(_COUNTER_KEY) :]: v for k, v in found.items()}


def check_ib_errors(inv: Inventory) -> CheckResult:
    """Error counters that rose since the baseline (see the module docstring).

    The baselines are rolled and written back to the cache.
    """
    now_s = inv.now.timestamp()
    window = COUNTER_WINDOW.total_seconds()
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    updates: dict[str, dict[str, Any]] = {}
    for node_id in sorted(inv.telemetry):
        current = _counter_snapshot(inv.ports(node_id))
        if not current:
            continue
        stored = inv.counter_baselines.get(node_id) or {}
        cur = stored.get("cur")
        if cur is None:
            stored = {"prev": None, "cur": {"at": now_s, "ports": current}}
            updates[node_id] = stored
        elif now_s - cur["at"] >= window:
            stored = {"prev": cur, "cur": {"at": now_s, "ports": current}}
            updates[node_id] = stored
        base = stored.get("prev") or stored["cur"]
        for label, counters in sorted(current.items()):
            before = base["ports"].get(label, {})
            for name, value in counters.items():
                old = before.get(name)
                if old is not None and value > old:
                    found.setdefault(node_id, []).append(f"{label} {name} +{value - old}")
                    if name in FAIL_COUNTERS:
                        fails.add(node_id)
    if updates:
        telemetry.best_effort(
            "doctor_baselines",
            lambda: cache.set_many({counter_key(k): v for k, v in updates.items()}, timeout=_COUNTER_TTL_S),
            None,
        )
        inv.counter_baselines.update(updates)
    return _verdict(
        "ib_errors",
        found,
        fails=fails,
        ok="no InfiniBand error counter is rising",
        bad="{n} node(s) with rising InfiniBand error counters",
        action="reseat or replace the cable of these ports (perfquery shows the counters; ibqueryerrors the "
        "switch side); a rising link_downed is a link that flaps and breaks running jobs",
    )


def check_ib_scan_coverage(inv: Inventory) -> CheckResult:
    """Active InfiniBand ports that their fabric's latest ibnetdiscover map does not show."""
    maps: dict[str, scans.FabricMap] = {}
    found: dict[str, list[str]] = {}
    # Fabrics with active ports and no map yet, and the nodes on them: "ok"
    # there would claim coverage nobody has checked.
    unscanned: dict[str, set[str]] = {}
    for n in inv.nodes:
        for p in inv.ports(n.id):
            key = fabric_rules.fabric_key(p, inv.canon)
            if not key.startswith("sm:"):
                continue
            scan = inv.scans.get(key)
            if scan is None or not scan.output:
                unscanned.setdefault(key, set()).add(n.id)
                continue
            if key not in maps:
                maps[key] = scans.fabric_map(key, scan.output)
            if maps[key].has_port(port_guid=p.port_guid, node_guid=p.node_guid) is False:
                when = scan.output_at or scan.at
                found.setdefault(n.id, []).append(
                    f"{scans.port_label(p.hca, p.port)} ({p.port_guid or p.node_guid}) absent from the scan of "
                    f"{key} taken {when:%Y-%m-%d %H:%M:%S}"
                )
    result = _verdict(
        "ib_scan_coverage",
        found,
        fails=set(),
        ok="every active InfiniBand port appears in its fabric's latest scan",
        bad="{n} node(s) with ports missing from their fabric's map",
        action="a port the map lacks is cabled elsewhere or came up after the scan: compare `ibstat` on the "
        "node with the switch's port, and wait for the next scan before recabling",
    )
    if not unscanned:
        return result
    never = [
        f"{key}: never scanned ({len(ids)} node(s): {', '.join(sorted(ids))})" for key, ids in sorted(unscanned.items())
    ]
    what = (
        f"{len(unscanned)} InfiniBand fabric(s) never scanned"
        if result.result == Result.PASS
        else f"{result.summary}; {len(unscanned)} fabric(s) never scanned"
    )
    todo = (
        "no ibnetdiscover map has come back for these fabrics: check that Celery beat runs "
        f"(a scan is asked every {settings.LLMGW_FABRIC_SCAN_INTERVAL} s) and that infiniband-diags is installed "
        "on their nodes; an admin can read the error of a failed scan at /admin/fabrics/"
    )
    return CheckResult(
        "ib_scan_coverage",
        Result.WARN,
        what,
        f"{result.action}; {todo}" if result.action else todo,
        sorted(set(result.nodes) | {i for ids in unscanned.values() for i in ids}),
        result.details + never,
    )


# --- GPUs, engines, replicas ------------------------------------------------


def check_gpu_health(inv: Inventory) -> CheckResult:
    """The wear and health problems agents report for their cards."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    # What the findings call for: the card (reset, replace) and/or the engine (an application XID).
    card_trouble = app_xids = False
    for n in inv.nodes:
        sensors = {s.get("index"): s for s in (inv.telemetry.get(n.id) or {}).get("gpus") or []}
        for g in inv.gpus(n.id):
            problems = list(g.problems or [])
            if g.ecc_errors:
                problems.append(f"{g.ecc_errors} uncorrected ECC errors")
                fails.add(n.id)
                card_trouble = True
            sensor = sensors.get(g.index) or {}
            wear_data = sensor.get("wear")
            if wear_data:
                try:
                    wear = wire.GPUWear.model_validate(wear_data)
                except ValueError:
                    wear = None
                if wear is not None:
                    problems.extend(gpu_rules.wear_problems(wear))
                    if wear.remap_failure or wear.remapped_rows_uncorrectable > 0 or wear.retired_pages_dbe > 0:
                        fails.add(n.id)
                    app_xid = wear.xid_errors > 0 and gpu_rules.xid_is_application(wear.last_xid)
                    if gpu_rules.hardware_xid(wear):
                        fails.add(n.id)
                    app_xids = app_xids or app_xid
                    # Everything in the wear column but an application XID is the card's.
                    card_trouble = card_trouble or len(gpu_rules.wear_problems(wear)) > int(app_xid)
            # The agent's own line for a fatal XID ("XID 79: ...") repeats the wear column's.
            said = {p.split(" (", 1)[0] for p in problems if p.startswith("XID ")}
            extra = [p for p in sensor.get("problems") or [] if p not in problems and p.split(":", 1)[0] not in said]
            card_trouble = card_trouble or bool(extra) or bool(g.problems)
            problems.extend(extra)
            for p in problems:
                found.setdefault(n.id, []).append(f"GPU {g.index}: {p}")
    actions = []
    if card_trouble:
        actions.append(
            "drain the node and reset the card (pending remaps and retirements need one); a card out of "
            "spare rows or with uncorrectable errors needs replacing"
        )
    if app_xids:
        actions.append(
            "an application XID (13, 31, 43, 45, 68) is the engine's own fault: read the shard's log and fix "
            "or restart the engine; do not reset the card for it"
        )
    return _verdict(
        "gpu_health",
        found,
        fails=fails,
        ok="no GPU reports wear or health problems",
        bad="{n} node(s) with GPU problems",
        action="; ".join(actions),
    )


def check_engine_installs(inv: Inventory) -> CheckResult:
    """Engine installations that failed."""
    found: dict[str, list[str]] = {}
    for i in inv.failed_installs:
        detail = f": {i.detail}" if i.detail else ""
        found.setdefault(i.node_id, []).append(f"{i.engine} {i.version} failed{detail}".replace("  ", " "))
    return _verdict(
        "engine_installs",
        found,
        fails=set(found),
        ok="no engine installation failed",
        bad="{n} node(s) with a failed engine installation",
        action="read the detail, fix the cause (disk space, network, a wheel for this CUDA), and reinstall "
        "the engine on the node from the admin",
    )


def check_replicas_pending(inv: Inventory) -> CheckResult:
    """Replicas waiting for a place, with the planner's reason."""
    if not inv.pending_replicas:
        return CheckResult("replicas_pending", Result.PASS, "no replica is waiting for a place")
    details = [
        f"{r.deployment.name}/{str(r.id)[:8]}: {r.reason or 'no reason recorded yet'}" for r in inv.pending_replicas
    ]
    return CheckResult(
        "replicas_pending",
        Result.WARN,
        f"{len(details)} replica(s) pending",
        "the reason says what is missing (free GPUs, a fabric, memory, power): free capacity, uncordon "
        "nodes, or change the deployment's profile or selector",
        [],
        details,
    )


CHECKS: tuple[Callable[[Inventory], CheckResult], ...] = (
    check_control_plane_liveness,
    check_nodes_reachable,
    check_clock_skew,
    check_nvlink_joined,
    check_nvlink_bandwidth,
    check_nvlink_health,
    check_nvlink_domains,
    check_imex,
    check_ib_physical_fabric,
    check_ib_ports,
    check_ib_subnet_manager,
    check_ib_errors,
    check_ib_scan_coverage,
    check_gpu_health,
    check_engine_installs,
    check_replicas_pending,
)

CHECK_NAMES: tuple[str, ...] = tuple(c.__name__.removeprefix("check_") for c in CHECKS)


def run_checks(inv: Inventory) -> list[CheckResult]:
    """Every check over one snapshot, in a fixed order."""
    return [check(inv) for check in CHECKS]


def run(*, now: dt.datetime) -> list[CheckResult]:
    """Load the inventory and run every check."""
    return run_checks(load_inventory(now=now))


def overall(results: Iterable[CheckResult]) -> Result:
    """The worst verdict among the results (pass when there are none)."""
    worst = Result.PASS
    for r in results:
        if _SEVERITY[r.result] > _SEVERITY[worst]:
            worst = r.result
    return worst


def report(results: list[CheckResult], *, now: dt.datetime) -> dict[str, Any]:
    """The doctor's answer as JSON-able data (the API's and `doctor --json`'s shape)."""
    return {"at": now.isoformat(), "result": str(overall(results)), "checks": [r.as_dict() for r in results]}


_LATEST_KEY = "doctor:latest"


def latest(
    *, now: dt.datetime, fresh: bool = False, inv: Inventory | None = None
) -> tuple[dt.datetime, list[CheckResult]]:
    """The doctor's results and when they were taken, reused for settings.LLMGW_DOCTOR_CACHE seconds.

    Every /metrics scrape (one per Prometheus server, every 15-30 s) and
    every API call used to rerun every check over the whole cluster; they now
    share one run, so what they show may be that many seconds old (the
    returned time says how old). `fresh` runs the checks anyway and stores
    the result; `inv`, a snapshot taken at `now`, saves reading one again.
    Two callers that miss at the same moment both run the checks: harmless.
    """
    if not fresh:
        hit = cached(now=now)
        if hit is not None:
            return hit
    results = run_checks(inv if inv is not None else load_inventory(now=now))
    telemetry.best_effort(
        "doctor", lambda: cache.set(_LATEST_KEY, (now, results), timeout=settings.LLMGW_DOCTOR_CACHE), None
    )
    return now, results


def cached(*, now: dt.datetime) -> tuple[dt.datetime, list[CheckResult]] | None:
    """The stored results when still fresh at `now` (see `latest`), else None."""
    hit = telemetry.best_effort("doctor", lambda: cache.get(_LATEST_KEY), None)
    if hit is not None and 0 <= (now - hit[0]).total_seconds() < settings.LLMGW_DOCTOR_CACHE:
        return hit
    return None


def forget_cached() -> None:
    """Drop the stored results, so the next caller runs the checks."""
    cache.delete(_LATEST_KEY)
