"""Rules about GPUs: their class, health, wear and NVLink domain membership.

Plain functions over plain values, so the models, the planner's snapshot and
the agent's reports all answer the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_MODEL_TOKEN = re.compile(r"\b(RTX\s+(?:PRO\s+)?[A-Z]?\d{4}[A-Z]*|[A-Z]{1,3}\d{2,4}[A-Z]*)\b")
_MEM_IN_NAME = re.compile(r"(\d{2,3})\s*GB", re.IGNORECASE)
_ZERO_UUID = re.compile(r"^[0-]*$")


def gpu_class(name: str, memory_total_mb: int | None) -> str:
    """A card's class for placement: model and memory, e.g. "H100-80GB".

    The memory is taken from the name when the name says it (the H100 80GB
    reports 79.6 GiB), else rounded from the reported total; a card whose
    model cannot be read keeps its name so it is at least grouped with its kind.
    """
    clean = (name or "").replace("NVIDIA", "").replace("Tesla", "").replace("GeForce", "").strip()
    m = _MODEL_TOKEN.search(clean.upper())
    model = m.group(1).replace(" ", "") if m else clean.replace(" ", "-")
    if not model:
        return ""
    mem = _MEM_IN_NAME.search(clean)
    if mem:
        return f"{model}-{int(mem.group(1))}GB"
    if memory_total_mb:
        return f"{model}-{round(memory_total_mb / 1024)}GB"
    return model


def healthy(ecc_errors: int | None, problems: Iterable[str] | None) -> bool:
    """A card with an uncorrected ECC fault, or any reported problem (another
    process on it, a fatal XID), is not free in any useful sense."""
    return not (ecc_errors or 0) and not list(problems or [])


# Fabric states of a card that reports no NVLink fabric at all (a PCIe card).
_NO_FABRIC_STATES = frozenset({"", "n/a", "not supported", "not_supported"})


def fabric_reported(state: str) -> bool:
    """Whether a card reports an NVLink fabric at all, joined or not (a PCIe card does not)."""
    return (state or "").strip().lower() not in _NO_FABRIC_STATES


def cluster_known(cluster_uuid: str) -> bool:
    """Whether a fabric cluster UUID names a cluster.

    A single machine's NVSwitch reports a cluster UUID of zeros: that is no
    domain anything outside the box can share.
    """
    uuid = (cluster_uuid or "").strip()
    return bool(uuid) and uuid.upper() != "N/A" and not _ZERO_UUID.match(uuid)


def domain_name(cluster_uuid: str, clique_id: str) -> str:
    """An NVLink domain's name: "<cluster>/<clique>", the cluster alone when the driver gives no clique."""
    uuid = (cluster_uuid or "").strip()
    clique = (clique_id or "").strip()
    return f"{uuid}/{clique}" if clique and clique.upper() != "N/A" else uuid


def fabric_joined(state: str, status: str, cluster_uuid: str) -> bool:
    """Whether a card has joined a multi-node NVLink fabric.

    A single machine's NVSwitch reports a completed fabric with a cluster UUID
    of zeros (see `cluster_known`): that is not joined to anything.
    """
    if (state or "").strip().lower() != "completed":
        return False
    if (status or "").strip().lower() != "success":
        return False
    return cluster_known(cluster_uuid)


def single_node_nvswitch(gpus: Iterable[Any]) -> bool:
    """Whether a node is one machine's NVSwitch (an HGX box): every card's fabric completed, no cluster named.

    Such a machine reports Completed / Success with a cluster UUID of zeros on
    every card: its NVLink ends at its own chassis, by design, and nothing in
    it is "not joined". A completed card with another status (Insufficient
    Resources) is a multi-node card that failed to join, not one of these.
    """
    seen = False
    for g in gpus:
        seen = True
        state, status = (g.fabric_state or "").strip().lower(), (g.fabric_status or "").strip().lower()
        if state != "completed" or status != "success":
            return False
        if cluster_known(g.cluster_uuid):
            return False
    return seen


def gpu_domain(state: str, status: str, cluster_uuid: str, clique_id: str) -> str:
    """The NVLink domain a card is joined to ("<cluster>/<clique>"), "" for none."""
    if not fabric_joined(state, status, cluster_uuid):
        return ""
    return domain_name(cluster_uuid, clique_id)


def bandwidth_degraded(bandwidth: str) -> bool:
    """Whether a joined card reports less than its full NVLink bandwidth."""
    b = (bandwidth or "").strip().lower()
    return b not in ("", "full", "n/a", "not supported")


# Health summaries that say the fabric is fine, or say nothing (older drivers).
_HEALTHY_SUMMARIES = frozenset({"", "healthy", "n/a", "not supported"})


def fabric_unhealthy(health: str) -> bool:
    """Whether a card's fabric health summary says it is not fit to carry NVLink traffic.

    "Unhealthy" and "Limited Capacity" (NVML's third summary) both count: the
    card is joined on paper, and a collective across the domain would stall
    or crawl on it. An empty or "Not Supported" summary is an older driver
    that does not say, never a fault.
    """
    return (health or "").strip().lower() not in _HEALTHY_SUMMARIES


def node_domain(gpus: Iterable[Any]) -> str:
    """The NVLink domain of a node: the one every card is joined to, "" otherwise.

    A node half joined (a card still coming up, or one that fell out) is in
    none: a replica that counts on its NVLink would find a card without it.
    A card whose fabric health is unhealthy or limited keeps its node out
    too. A node with no GPUs is in none either.
    """
    domain = ""
    seen = False
    for g in gpus:
        seen = True
        d = gpu_domain(g.fabric_state, g.fabric_status, g.cluster_uuid, g.clique_id)
        if not d or (domain and d != domain) or fabric_unhealthy(getattr(g, "fabric_health", "")):
            return ""
        domain = d
    return domain if seen else ""


def imex_up(state: str) -> bool:
    """Whether nvidia-imex reports itself ready."""
    return (state or "").strip().upper() in {"UP", "READY", "ACTIVE", "RUNNING"}


# XIDs that are the application's own fault (NVIDIA's XID catalogue, and the
# device plugin's skip list): an illegal address in a kernel, a graphics
# engine exception. The card is fine for the next process; resetting it for
# one of these costs the node's other shards and fixes nothing.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
# Advice for the hardware and driver XIDs the catalogue names; the rest of
# its "reset or RMA" class gets the general advice.
_XID_ADVICE = {
    48: "drain the node and reset the card",
    63: "drain the node and reset the card when idle",
    64: "drain the node, reset the card and have it serviced",
    74: "drain the node, check the NVLink and reset the card",
    79: "drain and reboot the node; replace the card if it recurs",
    92: "drain the node and reset the card; replace it if it recurs",
    94: "drain the node and reset the card",
    95: "drain the node and reset the card",
    119: "drain the node and reset the card; update the driver if it recurs",
    120: "drain the node and reset the card; update the driver if it recurs",
}


def xid_is_application(xid: int) -> bool:
    """Whether an XID is an application's fault (13, 31, 43, 45, 68), the card being fine."""
    return xid in APPLICATION_XIDS


def xid_advice(xid: int) -> str:
    """What an operator does about an XID: the engine for an application fault, the card for the rest."""
    if xid_is_application(xid):
        return "application fault: look at the engine's process and its log; the card needs no reset"
    action = _XID_ADVICE.get(xid, "drain the node and reset the card; replace it if it recurs")
    return f"hardware or driver fault: {action}"


def hardware_xid(wear: Any) -> bool:
    """Whether a card's wear carries an XID of the hardware or driver class (not an application's)."""
    return wear is not None and wear.xid_errors > 0 and wear.last_xid > 0 and not xid_is_application(wear.last_xid)


def wear_problems(wear: Any) -> list[str]:
    """What wears a card out, in a few words each; empty when nothing does.

    `wear` carries the wire's GPUWear fields; None (an agent that does not
    read wear) has no problems to tell.
    """
    if wear is None:
        return []
    out: list[str] = []
    if wear.remap_failure:
        out.append("out of spare memory rows: replace the card")
    if wear.remap_pending:
        out.append("memory rows remapped, waiting for a reset")
    if wear.retire_pending:
        out.append("memory pages waiting for a reset to be retired")
    if wear.remapped_rows_uncorrectable > 0:
        out.append(f"{wear.remapped_rows_uncorrectable} rows remapped for uncorrectable errors")
    if wear.retired_pages_dbe > 0:
        out.append(f"{wear.retired_pages_dbe} pages retired for double-bit errors")
    if wear.xid_errors > 0:
        out.append(f"XID {wear.last_xid} ({wear.last_xid_text}): {xid_advice(wear.last_xid)}")
    if wear.nvlink_crc_errors > 0 or wear.nvlink_replay_errors > 0 or wear.nvlink_recovery_errors > 0:
        out.append(
            f"NVLink errors: {max(wear.nvlink_crc_errors, 0)} CRC, "
            f"{max(wear.nvlink_replay_errors, 0)} replay, {max(wear.nvlink_recovery_errors, 0)} recovery"
        )
    return out
