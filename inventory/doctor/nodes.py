"""Checks on nodes and the control plane's view of them: reachability, the liveness sweep, clock skew."""

from __future__ import annotations

import datetime as dt

from django.conf import settings

from inventory import doctor_view
from inventory.doctor import registry
from inventory.doctor.loader import Inventory
from inventory.doctor.results import CheckResult, Findings, Result, verdict
from inventory.doctor_view import SKEW_FAIL_S, SKEW_WARN_S
from inventory.models import NodeState

__all__ = ["SKEW_FAIL_S", "SKEW_WARN_S", "check_clock_skew", "check_control_plane_liveness", "check_nodes_reachable"]


def find_nodes_reachable(inv: Inventory) -> Findings:
    """Each node that is lost (a failure) or unreachable."""
    f = Findings()
    for n in inv.nodes:
        if n.state == NodeState.LOST:
            f.found[n.id] = ["lost: its replicas were declared dead"]
            f.fails.add(n.id)
        elif n.state == NodeState.UNREACHABLE or n.unreachable_since is not None:
            since = n.unreachable_since or n.last_seen
            f.found[n.id] = [f"no heartbeat since {since:%Y-%m-%d %H:%M:%S}" if since else "no heartbeat"]
    return f


def verdict_nodes_reachable(f: Findings, inv: Inventory) -> CheckResult:
    """The reachability verdict over every node's findings."""
    return verdict(
        "nodes_reachable",
        f.found,
        fails=f.fails,
        ok="every node is heartbeating",
        bad="{n} node(s) not heartbeating",
        action="check the agent service and the management network on these nodes; a lost node's replicas "
        "are rebuilt elsewhere, and it returns to ready by itself when heartbeats resume",
    )


def check_nodes_reachable(inv: Inventory) -> CheckResult:
    """Nodes whose heartbeats stopped: unreachable is a warning, lost a failure."""
    return verdict_nodes_reachable(find_nodes_reachable(inv), inv)


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


def find_clock_skew(inv: Inventory) -> Findings:
    """Each node whose agent's clock is off by more than SKEW_WARN_S (SKEW_FAIL_S fails)."""
    f = Findings()
    for node_id, data in sorted(inv.telemetry.items()):
        skewed = doctor_view.skew(data)
        if skewed is not None:
            f.found[node_id] = [skewed[0]]
            if skewed[1]:
                f.fails.add(node_id)
    return f


def verdict_clock_skew(f: Findings, inv: Inventory) -> CheckResult:
    """The clock-skew verdict over every node's findings."""
    return verdict(
        "clock_skew",
        f.found,
        fails=f.fails,
        ok=f"every agent's clock is within {SKEW_WARN_S:g} s",
        bad="{n} node(s) with a skewed clock",
        action="enable time synchronisation (chrony or systemd-timesyncd) on these nodes against the "
        "control plane's time source",
    )


def check_clock_skew(inv: Inventory) -> CheckResult:
    """The agent's clock against the control plane's, read from the latest heartbeat."""
    return verdict_clock_skew(find_clock_skew(inv), inv)


registry.per_node(check_nodes_reachable, find=find_nodes_reachable, verdict=verdict_nodes_reachable)
registry.per_node(check_clock_skew, find=find_clock_skew, verdict=verdict_clock_skew)
