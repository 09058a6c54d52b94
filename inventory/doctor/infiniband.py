"""Checks on InfiniBand: physical fabrics, ports, subnet managers, error counters, scan coverage.

Error counters: a counter's absolute value says little (a port up for a year
has some symbol errors); a counter that rises does. The doctor keeps, per
node, two generations of counter baselines in the cache ("doctor:ibctr:<node>"),
rolled every `COUNTER_WINDOW`: the current values are compared with the
older one, so a rise stays visible for one to two windows whoever runs the
doctor and however often, and a counter that fell (a reset) is not a rise.

A node's first baseline is dated back by a phase of its own (up to half a
window, from its id), so the nodes of a fleet first seen together roll at
different refreshes ever after: rolled all at once, every ten minutes, the
kept doctor's refresh re-checked the whole fleet's counters in one go (1.1-
1.9 s of the worker's CPU at 10,000 nodes). Its first generation is the
shorter by that phase; every later one lasts a whole window. Baselines
written before this rule (no version) start anew once, spread.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any

from django.conf import settings
from django.core.cache import cache

import llmgw_wire as wire
from inventory import fabric as fabric_rules
from inventory import scans, telemetry
from inventory.doctor import registry
from inventory.doctor.loader import Inventory, counter_key
from inventory.doctor.results import CheckResult, Findings, Result, verdict

# How long one generation of counter baselines lasts (see the module docstring).
COUNTER_WINDOW = dt.timedelta(minutes=10)
# The stored baselines' shape: 2 dates a node's first baseline back by its phase.
BASELINE_VERSION = 2
_COUNTER_TTL_S = 24 * 3600

ERROR_COUNTERS = wire.IB_ERROR_COUNTERS
FAIL_COUNTERS = frozenset({"link_downed"})


def find_ib_physical_fabric(inv: Inventory) -> Findings:
    """Each node's findings of check_ib_physical_fabric, before the verdict."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        ports = inv.ports(n.id)
        for f in inv.fabrics(n.id):
            pf = fabric_rules.physical_fabric(f.hcas, ports, inv.canon)
            if pf.known and not pf.consistent:
                found.setdefault(n.id, []).append(f"fabric {f.name}: adapters on {', '.join(pf.keys)}")
    return Findings(found, set(found))


def verdict_ib_physical_fabric(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_ib_physical_fabric over every node's findings."""
    return verdict(
        "ib_physical_fabric",
        f.found,
        fails=f.fails,
        ok="every declared fabric sits on one physical fabric",
        bad="{n} node(s) with a declared fabric cabled to two physical fabrics",
        action="fix the cabling or the node's agent.yaml (fabrics: name, hcas): NCCL handed adapters on "
        "two fabrics hangs instead of failing; the planner avoids such nodes meanwhile",
    )


def check_ib_physical_fabric(inv: Inventory) -> CheckResult:
    """A declared fabric whose adapters are cabled to two physical fabrics."""
    return verdict_ib_physical_fabric(find_ib_physical_fabric(inv), inv)


def find_ib_ports(inv: Inventory) -> Findings:
    """Each node's findings of check_ib_ports, before the verdict."""
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
    return Findings(found, fails)


def verdict_ib_ports(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_ib_ports over every node's findings."""
    return verdict(
        "ib_ports",
        f.found,
        fails=f.fails,
        ok="every declared port is active at its declared rate",
        bad="{n} node(s) with ports down or slow",
        action="check the cable and the switch port (ibstat, ibportstate); a port that trains below its rate "
        "usually has a bad cable or transceiver",
    )


def check_ib_ports(inv: Inventory) -> CheckResult:
    """Ports of a declared fabric that are not active, or slower than the declared rate."""
    return verdict_ib_ports(find_ib_ports(inv), inv)


def find_ib_subnet_manager(inv: Inventory) -> Findings:
    """Each node's ports that see no master subnet manager (the failovers are the verdict's: they are the fleet's)."""
    found: dict[str, list[str]] = {}
    fails: set[str] = set()
    for n in inv.nodes:
        for p in inv.ports(n.id):
            if fabric_rules.port_active(p) and not fabric_rules.port_is_roce(p) and not p.sm_guid:
                why = f": {p.sm_error}" if p.sm_error else ""
                found.setdefault(n.id, []).append(f"{scans.port_label(p.hca, p.port)} sees no master SM{why}")
                fails.add(n.id)
    return Findings(found, fails)


def verdict_ib_subnet_manager(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_ib_subnet_manager over every node's findings and the recent failovers."""
    found = dict(f.found)
    for c in inv.sm_changes:
        line = f"{c.port} master SM {c.from_guid or '?'} -> {c.to_guid or '?'} at {c.at:%Y-%m-%d %H:%M:%S}"
        found[c.node_id] = [*found.get(c.node_id, ()), line]
    return verdict(
        "ib_subnet_manager",
        found,
        fails=f.fails,
        ok="every InfiniBand port sees a master subnet manager, and none failed over in the last hour",
        bad="{n} node(s) with subnet-manager trouble",
        action="with no master SM the fabric cannot route new paths: start opensm (or the switch's SM) on "
        "a standby; after a failover, find why the old master went (sminfo, the SM's log)",
    )


def check_ib_subnet_manager(inv: Inventory) -> CheckResult:
    """InfiniBand ports that see no master subnet manager, and recent SM failovers."""
    return verdict_ib_subnet_manager(find_ib_subnet_manager(inv), inv)


def _counter_snapshot(ports: list[Any]) -> dict[str, dict[str, int]]:
    return {
        scans.port_label(p.hca, p.port): {c: int(p.counters[c]) for c in ERROR_COUNTERS if c in p.counters}
        for p in ports
    }


def baseline_phase(node_id: str) -> float:
    """Seconds, in [0, half a COUNTER_WINDOW), by which a node's first counter baseline is dated back.

    From the node's id alone, so every process and every run agrees, and a
    fleet's nodes are spread evenly over the half window.
    """
    digest = hashlib.blake2b(node_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * COUNTER_WINDOW.total_seconds() / 2


def find_ib_errors(inv: Inventory) -> Findings:
    """Each node's error counters that rose since its baseline (see the module docstring).

    The baselines are rolled and written back to the cache (and into `inv`).
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
        if cur is None or stored.get("v") != BASELINE_VERSION:
            first = {"at": now_s - baseline_phase(node_id), "ports": current}
            stored = {"v": BASELINE_VERSION, "prev": None, "cur": first}
            updates[node_id] = stored
        elif now_s - cur["at"] >= window:
            stored = {"v": BASELINE_VERSION, "prev": cur, "cur": {"at": now_s, "ports": current}}
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
    return Findings(found, fails)


def verdict_ib_errors(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_ib_errors over every node's findings."""
    return verdict(
        "ib_errors",
        f.found,
        fails=f.fails,
        ok="no InfiniBand error counter is rising",
        bad="{n} node(s) with rising InfiniBand error counters",
        action="reseat or replace the cable of these ports (perfquery shows the counters; ibqueryerrors the "
        "switch side); a rising link_downed is a link that flaps and breaks running jobs",
    )


def check_ib_errors(inv: Inventory) -> CheckResult:
    """Error counters that rose since the baseline (see the module docstring).

    The baselines are rolled and written back to the cache.
    """
    return verdict_ib_errors(find_ib_errors(inv), inv)


def find_ib_scan_coverage(inv: Inventory) -> Findings:
    """Each node's active ports missing from their fabric's scan; flagged with the fabrics it is on.

    "on:<key>" for every scanned-or-not InfiniBand fabric the node's ports
    are on (a new scan of it re-checks the node), "unscanned:<key>" for one
    never scanned.
    """
    out = Findings()
    found = out.found
    for n in inv.nodes:
        for p in inv.ports(n.id):
            key = fabric_rules.fabric_key(p, inv.canon)
            if not key.startswith("sm:"):
                continue
            out.flag(n.id, f"on:{key}")
            scan = inv.scans.get(key)
            if scan is None or not scan.output:
                # Fabrics with active ports and no map yet, and the nodes on them: "ok"
                # there would claim coverage nobody has checked.
                out.flag(n.id, f"unscanned:{key}")
                continue
            if inv.fabric_map(key, scan).has_port(port_guid=p.port_guid, node_guid=p.node_guid) is False:
                when = scan.output_at or scan.at
                found.setdefault(n.id, []).append(
                    f"{scans.port_label(p.hca, p.port)} ({p.port_guid or p.node_guid}) absent from the scan of "
                    f"{key} taken {when:%Y-%m-%d %H:%M:%S}"
                )
    return out


def verdict_ib_scan_coverage(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_ib_scan_coverage over every node's findings and the fabrics never scanned."""
    unscanned: dict[str, set[str]] = {}
    for node_id, flags in f.flags.items():
        for flag in flags:
            if flag.startswith("unscanned:"):
                unscanned.setdefault(flag.removeprefix("unscanned:"), set()).add(node_id)
    result = verdict(
        "ib_scan_coverage",
        f.found,
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


def check_ib_scan_coverage(inv: Inventory) -> CheckResult:
    """Active InfiniBand ports that their fabric's latest ibnetdiscover map does not show."""
    return verdict_ib_scan_coverage(find_ib_scan_coverage(inv), inv)


registry.per_node(
    check_ib_physical_fabric,
    find=find_ib_physical_fabric,
    verdict=verdict_ib_physical_fabric,
    shares=frozenset({"canon"}),
)
registry.per_node(check_ib_ports, find=find_ib_ports, verdict=verdict_ib_ports)
registry.per_node(check_ib_subnet_manager, find=find_ib_subnet_manager, verdict=verdict_ib_subnet_manager)
registry.per_node(check_ib_errors, find=find_ib_errors, verdict=verdict_ib_errors, shares=frozenset({"baselines"}))
registry.per_node(
    check_ib_scan_coverage,
    find=find_ib_scan_coverage,
    verdict=verdict_ib_scan_coverage,
    shares=frozenset({"canon", "scans"}),
)
