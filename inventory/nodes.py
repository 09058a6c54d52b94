"""Node lifecycle: registration upsert, state transitions, heartbeats, labels.

Every change of state is a compare-and-set on the row and leaves an event,
so two writers cannot both move a node and the operator can read why it moved.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.db.models import Model

from inventory import changes
from inventory import gpus as gpu_rules
from inventory import labels as label_rules
from inventory.models import (
    GPU,
    NODE_TRANSITIONS,
    EngineInstall,
    FabricAttachment,
    LocalWeights,
    Node,
    NodeEvent,
    NodeState,
    Storage,
)
from llmgw import logs
from llmgw.db import insert_together, prepared_cursor
from llmgw_wire import engines as wire_engines

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    import llmgw_wire as wire

log = logging.getLogger(__name__)


class TransitionError(Exception):
    """A state change that the node's current state does not allow."""


def record_event(
    node_id: str,
    kind: str,
    message: str,
    *,
    now: dt.datetime,
    actor: AbstractBaseUser | None = None,
    actor_name: str = "",
    data: Mapping | None = None,
) -> NodeEvent:
    """Write one audit row for a node, and its INFO line once the caller commits."""
    event = event_row(node_id, kind, message, now=now, actor=actor, actor_name=actor_name, data=data)
    event.save(force_insert=True)
    return event


def event_row(
    node_id: str,
    kind: str,
    message: str,
    *,
    now: dt.datetime,
    actor: AbstractBaseUser | None = None,
    actor_name: str = "",
    data: Mapping | None = None,
) -> NodeEvent:
    """One audit row for a node, unsaved (the caller writes it), and its INFO line once the transaction commits."""
    name = actor_name or (actor.get_username() if actor is not None else "system")
    logs.after_commit(log, "node %s: %s: %s (by %s)", node_id, kind, message, name)
    return NodeEvent(
        node_id=node_id,
        node_name=node_id,
        at=now,
        kind=kind,
        actor=actor,
        actor_name=name,
        message=message,
        data=dict(data or {}),
    )


def change_state(
    node_id: str,
    new: NodeState | str,
    *,
    now: dt.datetime,
    expected: NodeState | str | None = None,
    reason: str = "",
    actor: AbstractBaseUser | None = None,
    actor_name: str = "",
) -> bool:
    """Move a node to `new` if its current state allows it.

    With `expected`, the move happens only from that state (a compare-and-set:
    the liveness sweep must not mark a node unreachable that a heartbeat has
    just brought back). Returns False when the node was no longer in the
    expected state; raises TransitionError when the move is never allowed.
    """
    new = NodeState(new)
    with transaction.atomic():
        node = Node.objects.select_for_update().only("id", "state").get(id=node_id)
        old = NodeState(node.state)
        if expected is not None and old != NodeState(expected):
            return False
        if old == new:
            return True
        if new not in NODE_TRANSITIONS[old]:
            raise TransitionError(f"node {node_id} cannot go from {old} to {new}")
        Node.objects.filter(id=node_id, state=old).update(state=new)
        changes.mark([node_id])
        text = f"{old} -> {new}" + (f": {reason}" if reason else "")
        record_event(
            node_id,
            "state",
            text,
            now=now,
            actor=actor,
            actor_name=actor_name,
            data={"from": str(old), "to": str(new), "reason": reason},
        )
    return True


def set_operator_labels(
    node_id: str, labels: Mapping[str, str], *, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> dict[str, str]:
    """Replace a node's operator labels and recompute the effective ones.

    A key the operator removes falls back to the agent's value, if it has one.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().get(id=node_id)
        before = dict(node.operator_labels)
        node.operator_labels = dict(labels)
        node.labels = label_rules.merge(node.agent_labels, node.operator_labels)
        node.save(update_fields=["operator_labels", "labels", "updated_at"])
        changes.mark([node_id])
        if before != node.operator_labels:
            record_event(
                node_id,
                "labels",
                f"operator labels {before} -> {node.operator_labels}",
                now=now,
                actor=actor,
                data={"from": before, "to": node.operator_labels},
            )
    return node.labels


def _gpu_fields(g: wire.GPU) -> dict:
    fabric = g.fabric
    return {
        "uuid": g.uuid,
        "name": g.name,
        "gpu_class": gpu_rules.gpu_class(g.name, g.memory_total_mb),
        "memory_total_mb": g.memory_total_mb or 0,
        "memory_used_mb": g.memory_used_mb or 0,
        "compute_capability": g.compute_capability,
        "numa_node": -1 if g.numa_node is None else g.numa_node,
        "pci_bus_id": g.pci_bus_id,
        "driver_version": g.driver_version,
        "cuda_version": g.cuda_version,
        "utilization_percent": g.utilization_percent or 0,
        "nvlink_peers": list(g.nvlink_peers),
        "nic_paths": dict(g.nic_paths),
        "fabric_state": fabric.state if fabric else "",
        "fabric_status": fabric.status if fabric else "",
        "cluster_uuid": fabric.cluster_uuid if fabric else "",
        "clique_id": fabric.clique_id if fabric else "",
        "fabric_bandwidth": fabric.bandwidth if fabric else "",
        "fabric_health": fabric.health if fabric else "",
        "ecc_errors": g.ecc_errors or 0,
        "temperature_c": g.temperature_c or 0,
        "problems": list(g.problems),
    }


def upsert_node(reg: wire.Register, *, now: dt.datetime, with_rows: Sequence[Model] = ()) -> tuple[Node, bool]:
    """Record a registration, preserving what the operator decided.

    An agent reconnecting must not silently undo a cordon or a drain, nor the
    operator's labels; an unreachable or lost node that registers is back.
    Returns the node and whether it was new. The hardware lists are replaced
    whole: the agent's report is the truth about its own machine.

    `with_rows`: unsaved rows of other tables about this node (a credential
    and its event) to insert with it, in the same statement when the node is new.
    """
    host = reg.host
    fields = {
        "hostname": reg.hostname,
        "mgmt_addr": reg.mgmt_addr,
        "metrics_addr": reg.metrics_addr or "",
        "last_seen": now,
        "registered_at": now,
        "unreachable_since": None,
        "agent_version": reg.agent_version,
        "features": list(reg.features),
        # Canonical names: an agent before the engine registry reported llama.cpp as `llama-server`.
        "engine_versions": wire_engines.canonical_versions(dict(reg.engine_versions)),
        "engines_probed": reg.engines_probed,
        "os_id": host.os_id if host else "",
        "os_version": host.os_version if host else "",
        "os_codename": host.os_codename if host else "",
        "arch": host.arch if host else "",
        "cpu_flags": list(host.cpu_flags) if host else [],
        "nvidia_driver": host.nvidia_driver if host else "",
        "memory_total_mb": reg.memory_total_mb or 0,
        "cpu_count": reg.cpu_count or 0,
        "agent_labels": dict(reg.labels),
        "imex_state": reg.imex.state if reg.imex else "",
        "imex_channels": reg.imex.channels if reg.imex else 0,
        "nvlink_domain": gpu_rules.node_domain([_Fabric(g.fabric) for g in reg.gpus]),
        "storage_reported": reg.storage is not None,
        "weights_reported": reg.weights is not None,
    }
    # No savepoint of its own: a registration is one transaction, and under a join storm
    # every statement saved is a round trip fewer for each of thousands of nodes.
    with transaction.atomic(savepoint=False):
        node = _locked(reg.node_id)
        created = node is None
        if created:
            node = Node(id=reg.node_id, state=NodeState.READY)
        previous_state = NodeState(node.state)
        for k, v in fields.items():
            setattr(node, k, v)
        node.labels = label_rules.merge(node.agent_labels, node.operator_labels)
        if previous_state in (NodeState.UNREACHABLE, NodeState.LOST):
            node.state = NodeState.READY
        if created:
            # A join storm is mostly new nodes: everything about one is a single statement.
            joined = event_row(node.id, "registered", "node joined", now=now, actor_name="agent")
            insert_together([node, joined, *_hardware_rows(node, reg), *with_rows])
            changes.mark([node.id])
            return node, created
        node.save()
        changes.mark([node.id])
        record_event(node.id, "registered", "agent re-registered", now=now, actor_name="agent")
        if previous_state != node.state:
            record_event(
                node.id,
                "state",
                f"{previous_state} -> {node.state}: agent registered",
                now=now,
                actor_name="agent",
                data={"from": str(previous_state), "to": str(node.state)},
            )
        _replace_hardware(node, reg)
        if with_rows:
            insert_together(with_rows)
    return node, created


def _locked(node_id: str) -> Node | None:
    """The node's row, locked for this transaction (select_for_update), None when there is none.

    Hand-written SQL: every registration of a storm asks, and building the
    ORM's SELECT of every column cost more than the rest of a new node's work.
    """
    if connection.vendor != "postgresql":
        # The embedded default's SQLite: its values want the backend's own converters.
        return Node.objects.select_for_update().filter(id=node_id).first()
    fields = Node._meta.concrete_fields
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    with prepared_cursor() as cur:
        cur.execute(f"SELECT {columns} FROM {quote(Node._meta.db_table)} WHERE id = %s FOR UPDATE", [node_id])
        row = cur.fetchone()
    if row is None:
        return None
    # As the ORM's compiler does: each field's own conversion (JSON decoded).
    values = [
        f.from_db_value(v, None, connection) if hasattr(f, "from_db_value") else v
        for f, v in zip(fields, row, strict=True)
    ]
    return Node.from_db(connection.alias, [f.attname for f in fields], values)


class _Fabric:
    """Adapter giving a wire GPU's fabric the attribute names node_domain reads."""

    def __init__(self, fabric: wire.GPUFabric | None) -> None:
        self.fabric_state = fabric.state if fabric else ""
        self.fabric_status = fabric.status if fabric else ""
        self.cluster_uuid = fabric.cluster_uuid if fabric else ""
        self.clique_id = fabric.clique_id if fabric else ""
        self.fabric_health = fabric.health if fabric else ""


def _fabric_rows(node: Node, reg: wire.Register) -> list[FabricAttachment]:
    return [FabricAttachment(node=node, name=f.name, hcas=list(f.hcas), rate_gbps=f.rate_gbps) for f in reg.fabrics]


def _storage_rows(node: Node, reg: wire.Register) -> list[Storage]:
    return [
        Storage(
            node=node, path=s.path, free_bytes=s.free_bytes, total_bytes=s.total_bytes, shared=s.shared, fstype=s.fstype
        )
        for s in {s.path: s for s in reg.storage or []}.values()
    ]


def _weights_rows(node: Node, reg: wire.Register) -> list[LocalWeights]:
    return [
        LocalWeights(node=node, path=w.path, size_bytes=w.size_bytes, shared=w.shared)
        for w in {w.path: w for w in reg.weights or []}.values()
    ]


def _install_rows(node_id: str, installs: list[wire.EngineInstall]) -> list[EngineInstall]:
    by_engine = {(wire_engines.canonical(i.engine) or i.engine): i for i in installs}
    return [
        EngineInstall(
            node_id=node_id, engine=engine, version=i.version, variant=i.variant, state=i.state, detail=i.detail
        )
        for engine, i in by_engine.items()
    ]


def _hardware_rows(node: Node, reg: wire.Register) -> list:
    """A new node's GPUs, fabrics, storage, weights and engine installs as the registration says, unsaved."""
    return [
        *(GPU(node=node, index=g.index, **_gpu_fields(g)) for g in reg.gpus),
        *_fabric_rows(node, reg),
        *_storage_rows(node, reg),
        *_weights_rows(node, reg),
        *_install_rows(node.id, reg.engine_installs or []),
    ]


def _replace_hardware(node: Node, reg: wire.Register) -> None:
    """A known node's GPUs, fabrics, storage, weights and engine installs as the registration says.

    A GPU is written only when it changed; the other lists are replaced whole.
    """
    existing = {g.index: g for g in node.gpus.all()}
    keep, new = set(), []
    for g in reg.gpus:
        keep.add(g.index)
        values = _gpu_fields(g)
        row = existing.get(g.index)
        if row is None:
            new.append(GPU(node=node, index=g.index, **values))
        elif any(getattr(row, k) != v for k, v in values.items()):
            GPU.objects.filter(pk=row.pk).update(**values)
    gone = set(existing) - keep
    if gone:
        GPU.objects.filter(node=node, index__in=gone).delete()
    if new:
        GPU.objects.bulk_create(new)

    FabricAttachment.objects.filter(node=node).delete()
    FabricAttachment.objects.bulk_create(_fabric_rows(node, reg))
    if reg.storage is not None:
        Storage.objects.filter(node=node).delete()
        Storage.objects.bulk_create(_storage_rows(node, reg))
    if reg.weights is not None:
        LocalWeights.objects.filter(node=node).delete()
        LocalWeights.objects.bulk_create(_weights_rows(node, reg))
    if reg.engine_installs is not None:
        replace_engine_installs(node.id, reg.engine_installs)


def replace_engine_installs(node_id: str, installs: list[wire.EngineInstall]) -> None:
    """Record where each engine's installation stands, as the agent last said."""
    by_engine = {(wire_engines.canonical(i.engine) or i.engine): i for i in installs}
    EngineInstall.objects.filter(node_id=node_id).exclude(engine__in=list(by_engine)).delete()
    for engine, i in by_engine.items():
        EngineInstall.objects.update_or_create(
            node_id=node_id,
            engine=engine,
            defaults={"version": i.version, "variant": i.variant, "state": i.state, "detail": i.detail},
        )
