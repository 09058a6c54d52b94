"""The doctor kept in memory by the worker, re-checking only the nodes whose facts changed.

A full run reads every node, card, fabric and telemetry entry and runs every
check over them: 6-7 s of the worker's CPU at ten thousand nodes, for every
refresh. Most checks are per node (results.Findings): what they find on a
node depends on that node's facts alone and on a few things the fleet
shares (the canonical subnet managers, the fabric scans). So the worker keeps
every per-node check's findings, node by node, with the facts they came
from, and a refresh re-checks:

- the nodes the change feed names since the last refresh (inventory/changes.py,
  the feed the placement index reads: registration, GPUs and their fabric and
  health, engine installs, IMEX, and a heartbeat whose telemetry differs in
  what the doctor reads, inventory/doctor_view.py);
- the nodes whose row changed in what a check reads (every row's state,
  IMEX, NVLink domain and unreachable time is read each refresh, one query:
  the liveness sweep's transitions are seen whoever marks them);
- the nodes silent long enough that their telemetry may have expired, and,
  for the error-counter check alone, the nodes whose counter baselines roll
  now (every COUNTER_WINDOW; at their kept ports, without reading telemetry);
- for the checks that read what the fleet shares, every node when the
  canonical subnet managers change, and the nodes on a fabric whose scan
  changed.

The checks that are not per node (the liveness sweep's health, failed
engine installs, placement's pending replicas, any check registered without
`registry.per_node`) run whole at every refresh over the kept snapshot; it
holds the nodes, their GPUs, fabrics and IB ports, not their telemetry, so a
check that reads telemetry must be declared per node.

A full run is the fallback: on first use, on a gap in the feed (a flushed
cache, a reader too far behind) or a change marked for every node, when the
registered checks change, and every LLMGW_DOCTOR_FULL_S seconds (default
1800) as a safety net against a change whose mark never reached the cache.
The merged results equal a full run's over the same facts
(tests/inventory/doctor/test_kept.py compares them exactly).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterable
from typing import Any

from django.conf import settings

from inventory import changes, scans
from inventory import fabric as fabric_rules
from inventory.doctor import registry
from inventory.doctor.infiniband import BASELINE_VERSION, COUNTER_WINDOW
from inventory.doctor.loader import (
    FabricRow,
    GPURow,
    Inventory,
    load_baselines,
    load_fleet,
    load_inventory,
    load_nodes,
)
from inventory.doctor.results import CheckResult, Findings
from inventory.models import FabricScan, Node, NodeState

DEFAULT_FULL_S = 1800.0
# What a refresh reads of every node's row: the facts the checks read, and when it was last heard.
_ROW_FIELDS = ("id", "state", "unreachable_since", "imex_state", "imex_channels", "nvlink_domain", "last_seen")


def full_interval_s() -> float:
    """Seconds between full runs when the feed says nothing (the safety net)."""
    return float(getattr(settings, "LLMGW_DOCTOR_FULL_S", DEFAULT_FULL_S))


def _row_facts(row: tuple) -> tuple:
    # last_seen moves with every lease; a check reads it only for an unreachable node with no
    # unreachable time, which hears nothing, so only there is it a fact.
    _, state, since, imex_state, imex_channels, domain, last_seen = row
    seen = last_seen if state == NodeState.UNREACHABLE and since is None else None
    return state, since, imex_state, imex_channels, domain, seen


def _sm_facts(ports: list[Any]) -> tuple:
    # What canonical_sms reads of a node's ports.
    return tuple((p.sm_guid, tuple(getattr(s, "guid", None) for s in p.sms or ())) for p in ports)


class KeptDoctor:
    """One process's doctor: per-node findings of every per-node check, the facts behind them, the feed's version."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.names: tuple[str, ...] = ()
        self.nodes: dict[str, Node] = {}
        self.rows: dict[str, tuple] = {}
        self.gpus: dict[str, list[GPURow]] = {}
        self.fabrics: dict[str, list[FabricRow]] = {}
        self.ports: dict[str, list[Any]] = {}
        self.sms: dict[str, tuple] = {}
        self.canon: dict[str, str] = {}
        self.scans: dict[str, FabricScan] = {}
        self.fabric_maps: dict[str, tuple[tuple, Any]] = {}
        self.findings: dict[registry.Check, Findings] = {}
        # When each node's counter baseline rolls (unix seconds): its findings may change then.
        self.roll_due: dict[str, float] = {}
        self.built_at = 0.0
        # What happened, for the tests and the benchmark.
        self.full_runs = 0
        self.rechecked = 0
        self.rolled = 0
        # The nodes the last refresh read again (every node after a full run).
        self.last: set[str] = set()
        self.lock = threading.Lock()

    def refresh(self, *, now: dt.datetime, full: bool = False) -> list[CheckResult]:
        """Every check's result at `now`: the changed nodes re-checked, or a full run when it must."""
        with self.lock:
            if (
                full
                or self.version is None
                or self.names != registry.check_names()
                or time.monotonic() - self.built_at > full_interval_s()
            ):
                return self._full(now)
            feed = changes.since(self.version)
            if feed.everything:
                return self._full(now)
            results = self._incremental(now, set(feed.node_ids))
            self.version = feed.version
            return results

    # -- a full run --------------------------------------------------------------
    def _full(self, now: dt.datetime) -> list[CheckResult]:
        # The version first: whatever is marked from here on is re-checked next time.
        version = changes.current_version()
        inv = load_inventory(now=now)
        inv.fabric_maps = self.fabric_maps
        results: list[CheckResult] = []
        findings: dict[registry.Check, Findings] = {}
        for check in registry.checks():
            spec = registry.per_node_of(check)
            if spec is None:
                results.append(check(inv))
            else:
                findings[check] = spec.find(inv)
                results.append(spec.verdict(findings[check], inv))
        self.names = registry.check_names()
        self.findings = findings
        self.nodes = {n.id: n for n in inv.nodes}
        self.rows = {n.id: _row_facts(tuple(getattr(n, f) for f in _ROW_FIELDS)) for n in inv.nodes}
        self.gpus, self.fabrics = inv.node_gpus, inv.node_fabrics
        self.canon = inv.canon
        self.ports = {n: inv.ports(n) for n in inv.telemetry}
        self.sms = {n: _sm_facts(p) for n, p in self.ports.items()}
        self.scans = inv.scans
        self.roll_due = _roll_due(inv.counter_baselines, inv.telemetry)
        self.version = version
        self.built_at = time.monotonic()
        self.full_runs += 1
        self.rechecked += len(self.nodes)
        self.last = set(self.nodes)
        return results

    # -- a refresh of what changed ----------------------------------------------------
    def _incremental(self, now: dt.datetime, marked: set[str]) -> list[CheckResult]:
        ids = set(marked)
        now_s = now.timestamp()
        quiet = now_s - settings.LLMGW_TELEMETRY_TTL / 2
        rows: dict[str, tuple] = {}
        for row in Node.objects.order_by().values_list(*_ROW_FIELDS):
            facts = rows[row[0]] = _row_facts(row)
            if self.rows.get(row[0]) != facts:
                ids.add(row[0])
            elif row[0] in self.ports and (row[-1] is None or row[-1].timestamp() <= quiet):
                # Silent for half the telemetry's lifetime: its telemetry may be gone any moment.
                ids.add(row[0])
        ids |= self.rows.keys() - rows.keys()
        ids.discard(changes.ALL)
        # Nodes whose counter baseline rolls now: only the check that reads baselines looks again, at the
        # kept ports (their error counters are current: a change of one marks the node).
        due = {n for n, at in self.roll_due.items() if at <= now_s} - ids

        fresh = load_nodes(now=now, node_ids=ids & rows.keys())
        fresh_ports = {n: scans.ports_of(d) for n, d in fresh.telemetry.items()}
        sms_changed = False
        for n in ids:
            self.rows.pop(n, None)
            self.nodes.pop(n, None)
            self.gpus.pop(n, None)
            self.fabrics.pop(n, None)
            self.ports.pop(n, None)
            self.roll_due.pop(n, None)
            before = self.sms.pop(n, ())
            if n in fresh_ports:
                self.ports[n] = fresh_ports[n]
                self.sms[n] = _sm_facts(fresh_ports[n])
            sms_changed = sms_changed or self.sms.get(n, ()) != before
        for node in fresh.nodes:
            self.nodes[node.id] = node
            self.rows[node.id] = rows[node.id]
        for n in fresh.nodes:
            if n.id in fresh.node_gpus:
                self.gpus[n.id] = fresh.node_gpus[n.id]
            if n.id in fresh.node_fabrics:
                self.fabrics[n.id] = fresh.node_fabrics[n.id]
        self.nodes = dict(sorted(self.nodes.items()))

        canon_changed = False
        if sms_changed:
            canon = fabric_rules.canonical_sms(p for ports in self.ports.values() for p in ports)
            canon_changed, self.canon = canon != self.canon, canon
        scans_changed = self._reload_scans()

        fleet = self._snapshot(now, self.nodes.keys(), telemetry={}, baselines={})
        load_fleet(fleet, scans=False)
        results: list[CheckResult] = []
        for check in registry.checks():
            spec = registry.per_node_of(check)
            if spec is None:
                results.append(check(fleet))
                continue
            kept = self.findings[check]
            if canon_changed and "canon" in spec.shares:
                # Every node's fabric may be named anew: the whole check over what is kept.
                kept = self.findings[check] = spec.find(fleet)
            else:
                again = set(ids)
                if scans_changed and "scans" in spec.shares:
                    on = {f"on:{k}" for k in scans_changed}
                    again |= {n for n, flags in kept.flags.items() if flags & on}
                telemetry, baselines = fresh.telemetry, fresh.counter_baselines
                if due and "baselines" in spec.shares:
                    again |= due
                    # Their telemetry is not read: the check reads the kept ports of every node heard of.
                    telemetry = {**{n: {} for n in due}, **fresh.telemetry}
                    baselines.update(load_baselines(due))
                part = self._snapshot(now, again, telemetry=telemetry, baselines=baselines)
                kept.replace(again, spec.find(part))
            results.append(spec.verdict(kept, fleet))
        self.roll_due.update(_roll_due(fresh.counter_baselines, [*fresh.telemetry, *due]))
        self.rechecked += len(ids)
        self.rolled += len(due)
        self.last = ids
        return results

    def _snapshot(
        self, now: dt.datetime, node_ids: Iterable[str], *, telemetry: dict[str, Any], baselines: dict[str, Any]
    ) -> Inventory:
        """The kept facts of these nodes as a snapshot (telemetry and baselines only those given)."""
        ids = sorted(i for i in node_ids if i in self.nodes)
        inv = Inventory(
            now=now,
            nodes=[self.nodes[i] for i in ids],
            telemetry={i: telemetry[i] for i in ids if i in telemetry},
            scans=self.scans,
            counter_baselines=baselines,
            node_gpus={i: self.gpus[i] for i in ids if i in self.gpus},
            node_fabrics={i: self.fabrics[i] for i in ids if i in self.fabrics},
            fabric_maps=self.fabric_maps,
        )
        inv._ports = {i: self.ports[i] for i in ids if i in self.ports}
        inv._canon = self.canon
        return inv

    def _reload_scans(self) -> set[str]:
        """Bring the kept scans up to date, reading the text of changed ones only; the keys that changed."""
        seen = {s.key: (s.at, s.output_at) for s in FabricScan.objects.defer("output")}
        had = {k: (s.at, s.output_at) for k, s in self.scans.items()}
        changed = {k for k in seen.keys() | had.keys() if seen.get(k) != had.get(k)}
        if changed:
            for k in self.scans.keys() - seen.keys():
                del self.scans[k]
            for s in FabricScan.objects.filter(key__in=changed & seen.keys()):
                self.scans[s.key] = s
            self.scans = dict(sorted(self.scans.items()))
        return changed


def _roll_due(baselines: dict[str, Any], node_ids: Iterable[str]) -> dict[str, float]:
    window = COUNTER_WINDOW.total_seconds()
    due: dict[str, float] = {}
    for n in node_ids:
        stored = baselines.get(n) or {}
        cur = stored.get("cur")
        if cur is not None and stored.get("v") == BASELINE_VERSION:
            due[n] = cur["at"] + window
    return due


_KEPT = KeptDoctor()


def refresh(*, now: dt.datetime, full: bool = False) -> list[CheckResult]:
    """This process's kept doctor brought up to `now` (see the module docstring); every check's result."""
    return _KEPT.refresh(now=now, full=full)


def kept() -> KeptDoctor:
    """This process's kept doctor (the tests and the benchmark read its counters)."""
    return _KEPT


def reset() -> None:
    """Forget what this process kept: the next refresh is a full run."""
    global _KEPT
    _KEPT = KeptDoctor()
