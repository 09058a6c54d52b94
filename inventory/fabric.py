"""InfiniBand and RoCE fabrics: which physical fabric a port is on, and its history.

A declared fabric (agent.yaml's `name`) is the operator's word; the physical
fabric is what the cabling says: the master subnet manager on InfiniBand, the
IP network on RoCE. The two must agree before NCCL is handed an adapter.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction

from inventory.models import FabricScan, SMChange


def canonical_guid(guid: str) -> str:
    """A GUID in one spelling: lower case, 0x-prefixed, 16 hex digits."""
    g = (guid or "").strip().lower()
    if not g:
        return ""
    if g.startswith("0x"):
        g = g[2:]
    g = g.replace(":", "")
    try:
        return f"0x{int(g, 16):016x}"
    except ValueError:
        return (guid or "").strip().lower()


def port_active(port: Any) -> bool:
    """Whether the port can carry traffic (sysfs "4: ACTIVE" or "ACTIVE")."""
    state = (port.state or "").upper()
    return state == "ACTIVE" or state.endswith(": ACTIVE") or state == "4"


def port_is_roce(port: Any) -> bool:
    """Whether the port is Ethernet carrying RDMA."""
    return (port.link_layer or "").strip().lower() == "ethernet"


def fabric_key(port: Any, canon: Mapping[str, str] | None = None) -> str:
    """The physical fabric a port is on: "roce:<network>" or "sm:<master SM GUID>".

    Empty when not known and for a port that is not up. With `canon`, the
    subnet manager is named as the canonical map has it, so a fabric keeps one
    key through a failover.
    """
    if not port_active(port):
        return ""
    if port_is_roce(port):
        return f"roce:{port.network}" if port.network else ""
    if port.sm_guid:
        g = canonical_guid(port.sm_guid)
        return "sm:" + (canon or {}).get(g, g)
    return ""


def canonical_sms(ports: Iterable[Any]) -> dict[str, str]:
    """Map every subnet-manager GUID heard of to one name for its fabric.

    The name is the lowest GUID among managers ever listed together. A
    fabric's master changes on a failover and its list does not, so ports that
    see the old master and ports that already see the new one stay one fabric.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra == rb:
            return
        if ra < rb:
            parent[rb] = ra
        else:
            parent[ra] = rb

    for p in ports:
        master = canonical_guid(p.sm_guid)
        if master:
            find(master)
        for sm in p.sms or []:
            g = canonical_guid(sm.guid)
            if not g:
                continue
            if master:
                union(g, master)
            else:
                find(g)
    return {g: find(g) for g in list(parent)}


@dataclass(frozen=True)
class PhysicalFabric:
    """Where a declared fabric's adapters are cabled.

    known: some adapter said. consistent: they all said the same.
    """

    key: str
    known: bool
    consistent: bool
    keys: tuple[str, ...] = ()


def physical_fabric(
    hcas: Iterable[str], ports: Iterable[Any], canon: Mapping[str, str] | None = None
) -> PhysicalFabric:
    """The physical fabric a declared fabric's adapters sit on.

    Two adapters declared as one fabric but cabled to two is an error the
    doctor reports and the planner avoids: NCCL would pair peers that cannot
    reach each other.
    """
    wanted = set(hcas)
    keys = sorted({k for p in ports if p.hca in wanted for k in [fabric_key(p, canon)] if k})
    if not keys:
        return PhysicalFabric("", known=False, consistent=True)
    if len(keys) > 1:
        return PhysicalFabric("", known=True, consistent=False, keys=tuple(keys))
    return PhysicalFabric(keys[0], known=True, consistent=True, keys=tuple(keys))


def record_sm_change(*, at: dt.datetime, node_id: str, port: str, from_guid: str, to_guid: str) -> SMChange:
    """Keep a port's change of master subnet manager, the newest few hundred of them."""
    keep = settings.LLMGW_SM_CHANGES_KEPT
    with transaction.atomic():
        change = SMChange.objects.create(at=at, node_id=node_id, port=port, from_guid=from_guid, to_guid=to_guid)
        stale = SMChange.objects.order_by("-at", "-id").values_list("id", flat=True)[keep:]
        stale_ids = list(stale)
        if stale_ids:
            SMChange.objects.filter(id__in=stale_ids).delete()
    return change


def set_scan(
    *, key: str, at: dt.datetime, node_id: str, port: str, output: str, error: str, took_s: float
) -> FabricScan:
    """Keep a fabric's latest scan.

    A failed one does not replace a good one's text: a map from ten minutes
    ago is worth more than none. It records its error beside that text.
    """
    with transaction.atomic():
        scan, created = FabricScan.objects.select_for_update().get_or_create(
            key=key,
            defaults={
                "at": at,
                "node_id": node_id,
                "port": port,
                "output": output,
                "error": error,
                "took_s": took_s,
                "output_at": at if output else None,
            },
        )
        if created:
            return scan
        scan.at, scan.node_id, scan.port, scan.took_s = at, node_id, port, took_s
        if error and scan.output:
            scan.error = error
        else:
            scan.output, scan.error = output, error
            scan.output_at = at if output else None
        scan.save()
    return scan
