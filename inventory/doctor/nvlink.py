"""Checks on multi-node NVLink: fabric membership, bandwidth, health, domains, IMEX."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from inventory import gpus as gpu_rules
from inventory.doctor import registry
from inventory.doctor.loader import Inventory
from inventory.doctor.results import CheckResult, Findings, verdict


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


def find_nvlink_joined(inv: Inventory) -> Findings:
    """Each node's findings of check_nvlink_joined, before the verdict."""
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
    return Findings(found, set(found))


def verdict_nvlink_joined(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_nvlink_joined over every node's findings."""
    return verdict(
        "nvlink_joined",
        f.found,
        fails=f.fails,
        ok="every card of every NVLink node is joined",
        bad="{n} node(s) with cards not joined to their NVLink fabric",
        action="check nvidia-fabricmanager on the node and the tray's NVLink cabling; restarting the fabric "
        "manager drops every card, so drain the node first",
    )


def check_nvlink_joined(inv: Inventory) -> CheckResult:
    """Cards not joined to the NVLink fabric on a node that has one."""
    return verdict_nvlink_joined(find_nvlink_joined(inv), inv)


def find_nvlink_bandwidth(inv: Inventory) -> Findings:
    """Each node's findings of check_nvlink_bandwidth, before the verdict."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        for g in inv.gpus(n.id):
            joined = gpu_rules.fabric_joined(g.fabric_state, g.fabric_status, g.cluster_uuid)
            if joined and gpu_rules.bandwidth_degraded(g.fabric_bandwidth):
                found.setdefault(n.id, []).append(f"GPU {g.index} NVLink bandwidth {g.fabric_bandwidth}")
    return Findings(found)


def verdict_nvlink_bandwidth(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_nvlink_bandwidth over every node's findings."""
    return verdict(
        "nvlink_bandwidth",
        f.found,
        fails=f.fails,
        ok="no degraded NVLink bandwidth",
        bad="{n} node(s) with degraded NVLink bandwidth",
        action="a card with degraded links slows every collective it is in: check the NVLink cables or "
        "trays and the NVLink error counters (nvidia-smi nvlink -e)",
    )


def check_nvlink_bandwidth(inv: Inventory) -> CheckResult:
    """Joined cards that report less than their full NVLink bandwidth."""
    return verdict_nvlink_bandwidth(find_nvlink_bandwidth(inv), inv)


def find_nvlink_health(inv: Inventory) -> Findings:
    """Each node's findings of check_nvlink_health, before the verdict."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        for g in inv.gpus(n.id):
            if gpu_rules.fabric_unhealthy(g.fabric_health):
                found.setdefault(n.id, []).append(
                    f"GPU {g.index} NVLink fabric health {g.fabric_health}: the node is kept out of multi-node "
                    "NVLink placement"
                )
    return Findings(found, set(found))


def verdict_nvlink_health(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_nvlink_health over every node's findings."""
    return verdict(
        "nvlink_health",
        f.found,
        fails=f.fails,
        ok="no card reports an unhealthy NVLink fabric",
        bad="{n} node(s) with a card whose NVLink fabric is unhealthy",
        action="read `nvidia-smi -q` Fabric > Health on the card (Incorrect Configuration, Route Unhealthy, "
        "Partition Assigned say why) and the fabric manager's log; drain the node before restarting the "
        "fabric manager, which drops every card",
    )


def check_nvlink_health(inv: Inventory) -> CheckResult:
    """Cards whose driver says their NVLink fabric is unhealthy or of limited capacity."""
    return verdict_nvlink_health(find_nvlink_health(inv), inv)


def find_nvlink_domains(inv: Inventory) -> Findings:
    """Each node's findings of check_nvlink_domains, before the verdict."""
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
    return Findings(found, set(found))


def verdict_nvlink_domains(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_nvlink_domains over every node's findings."""
    return verdict(
        "nvlink_domains",
        f.found,
        fails=f.fails,
        ok="no node is split between NVLink domains",
        bad="{n} node(s) with cards in two NVLink domains",
        action="the tray is cabled or configured into two NVLink partitions; fix the partition in the "
        "fabric manager (or the cabling) so every card of a node is in one domain",
    )


def check_nvlink_domains(inv: Inventory) -> CheckResult:
    """A node whose cards are joined to two different NVLink domains."""
    return verdict_nvlink_domains(find_nvlink_domains(inv), inv)


def find_imex(inv: Inventory) -> Findings:
    """Each node's findings of check_imex, before the verdict."""
    found: dict[str, list[str]] = {}
    for n in inv.nodes:
        in_domain = bool(n.nvlink_domain) or bool(gpu_rules.node_domain(inv.gpus(n.id)))
        if not in_domain:
            continue
        if not n.imex_up():
            found[n.id] = [f"IMEX {n.imex_state or 'not reported'}"]
        elif n.imex_channels <= 0:
            found[n.id] = ["IMEX up without a channel"]
    return Findings(found, set(found))


def verdict_imex(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_imex over every node's findings."""
    return verdict(
        "imex",
        f.found,
        fails=f.fails,
        ok="IMEX is up with a channel on every node in an NVLink domain",
        bad="{n} node(s) in an NVLink domain without working IMEX",
        action="start nvidia-imex (systemctl start nvidia-imex) with every domain member in its nodes_config, "
        "and create a channel (/dev/nvidia-caps-imex-channels/channel0); without it the domain's GPUs "
        "cannot share memory across nodes",
    )


def check_imex(inv: Inventory) -> CheckResult:
    """IMEX down, or without a channel, on a node that is in an NVLink domain."""
    return verdict_imex(find_imex(inv), inv)


registry.per_node(check_nvlink_joined, find=find_nvlink_joined, verdict=verdict_nvlink_joined)
registry.per_node(check_nvlink_bandwidth, find=find_nvlink_bandwidth, verdict=verdict_nvlink_bandwidth)
registry.per_node(check_nvlink_health, find=find_nvlink_health, verdict=verdict_nvlink_health)
registry.per_node(check_nvlink_domains, find=find_nvlink_domains, verdict=verdict_nvlink_domains)
registry.per_node(check_imex, find=find_imex, verdict=verdict_imex)
