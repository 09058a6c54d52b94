"""Placing a replica: plan it over a snapshot, then write it whole in one transaction.

Allocations, shard rows and StartShard commands are written together, so a
replica is placed whole or not at all; the database's one-shard-per-GPU
constraint makes a second reconciler racing for the same cards roll back,
never double-book.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import IntegrityError, OperationalError, transaction

import wire
from inventory import allocation, outbox
from placement import planner, replicas
from placement.models import Deployment, Replica, ReplicaState, Shard
from placement.snapshot import Snapshot
from wire import shard_states

if TYPE_CHECKING:
    from placement.batch_writes import BatchWriter

log = logging.getLogger(__name__)

RS = ReplicaState
SS = shard_states.S


def place(
    row: Replica,
    dep: Deployment,
    snap: Snapshot,
    refused: dict[int, planner.NoPlace],
    *,
    now: dt.datetime,
    avoid: dict[str, str] | None = None,
    batch: BatchWriter | None = None,
) -> str:
    """Plan one pending replica and write it whole; "placed", "pending" or "conflict".

    With a `batch`, the plan is added to it, written when it fills or closes ("placed" meanwhile).

    `refused` keeps each deployment's refusal over this snapshot: planning is
    pure, so a second replica of it would be refused alike, node by node.
    """
    result = refused.get(dep.id)
    if result is None:
        req = planner.ReplicaRequest.from_profile(dep.profile, selector=dep.node_selector, avoid=avoid)
        result = planner.plan(req, snap, policy=dep.policy)
    if isinstance(result, planner.NoPlace):
        refused[dep.id] = result
        reasons = dict(list(result.reasons.items())[:500])
        if row.reason != result.reason or row.pending_reasons != reasons:
            Replica.objects.filter(id=row.id, state=RS.PENDING).update(
                reason=result.reason, pending_reasons=reasons, updated_at=now
            )
            row.reason, row.pending_reasons = result.reason, reasons
        return "pending"
    if batch is not None:
        batch.add(row, dep, result)
        return "placed"
    try:
        with transaction.atomic():
            write_placement(row, dep, result, snap, now=now)
    except IntegrityError:
        log.info("replica %s lost a race for its GPUs; retrying", row.id)
        return "conflict"
    except OperationalError as e:
        # Two writers waiting on each other's cards: the database picks one to lose.
        if "deadlock" not in str(e).lower():
            raise
        log.info("replica %s deadlocked with another placement; retrying", row.id)
        return "conflict"
    snap.reserve(result)
    return "placed"


@dataclass
class Rows:
    """What placing one replica writes, computed before anything is: both writers (this one, and
    placement/batch_writes.py for a scale-up) write exactly these."""

    # (node id, shard id, sorted GPU indices, memory GB, cores, watts) per shard.
    claims: list[tuple[str, uuid.UUID, list[int], int, int, float]]
    shards: list[Shard]
    # (node id, message) in the order they are queued: per shard an InstallEngine where asked, then its StartShard.
    commands: list[tuple[str, outbox.WireCommand]]
    # The replica's fields as it moves to starting (reason, NVLink domain, fabric, endpoint, profile fingerprint).
    fields: dict[str, str]


def placement_rows(row: Replica, dep: Deployment, result: planner.Plan, snap: Snapshot, *, now: dt.datetime) -> Rows:
    """The rows placing `row` as `result` writes; raises on a profile the wire cannot carry."""
    profile = dep.profile
    fp = profile.fingerprint()
    leader = result.shards[0]
    leader_addr = snap.nodes[leader.node_id].mgmt_addr
    env = {**(profile.env or {}), **result.env}
    wire_profile = wire.EngineProfile(
        name=profile.name,
        engine=profile.engine,
        gpu_class=profile.gpu_class,
        tp=profile.tp,
        pp=profile.pp,
        gpus_per_node=profile.gpus_per_node,
        nodes=profile.nodes,
        args=list(profile.args or []),
        env=env,
        model_path=profile.model_path,
        served_model_name=profile.served_model_name or dep.served_model,
    )
    out = Rows(claims=[], shards=[], commands=[], fields={})
    for s in result.shards:
        shard_id = uuid.uuid4()
        out.claims.append((s.node_id, shard_id, sorted(set(s.gpu_indices)), s.memory_gb, s.cpu_cores, s.power_w))
        out.shards.append(
            Shard(
                id=shard_id,
                replica=row,
                node_id=s.node_id,
                rank=s.rank,
                gpu_indices=list(s.gpu_indices),
                hcas=list(s.hcas),
                http_port=s.http_port,
                state=SS.PENDING,
                profile_fp=fp,
                created_at=now,
                updated_at=now,
            )
        )
    for s, shard in zip(result.shards, out.shards, strict=True):
        if s.install_engine:
            out.commands.append((s.node_id, wire.InstallEngine(engine=profile.engine, version=profile.engine_version)))
        start = wire.StartShard(
            replica_id=str(row.id),
            shard_id=str(shard.id),
            rank=s.rank,
            nnodes=len(result.shards),
            leader_addr=leader_addr,
            leader_port=leader.leader_port or None,
            gpu_indices=list(s.gpu_indices),
            hcas=list(s.hcas),
            http_port=s.http_port,
            profile=wire_profile,
            startup_timeout_s=float(profile.startup_timeout_s),
            pool=dep.pool,
            fabric=result.fabric_name,
            nvlink_domain=result.nvlink_domain,
            profile_fp=fp,
        )
        out.commands.append((s.node_id, start))
    where = result.nvlink_domain and f" in NVLink domain {result.nvlink_domain}"
    where = where or (result.fabric and f" on fabric {result.fabric_name} ({result.fabric})") or ""
    out.fields = {
        "reason": f"placed on {', '.join(result.node_ids)}{where}",
        "nvlink_domain": result.nvlink_domain,
        "fabric": result.fabric,
        "fabric_name": result.fabric_name,
        "endpoint": f"http://{leader_addr}:{leader.http_port}",
        "profile_fp": fp,
    }
    return out


def write_placement(row: Replica, dep: Deployment, result: planner.Plan, snap: Snapshot, *, now: dt.datetime) -> None:
    """Allocations, shard rows, StartShard commands and the replica's move, in the caller's transaction."""
    rows = placement_rows(row, dep, result, snap, now=now)
    for node_id, shard_id, gpus, memory_gb, cpu_cores, power_w in rows.claims:
        allocation.allocate(
            node_id=node_id,
            replica_id=row.id,
            shard_id=shard_id,
            gpu_indices=gpus,
            memory_gb=memory_gb,
            cpu_cores=cpu_cores,
            power_w=power_w,
        )
    Shard.objects.bulk_create(rows.shards)
    for node_id, message in rows.commands:
        outbox.enqueue(node_id, message, now=now)
    moved = replicas.change_state(row, RS.STARTING, now=now, pending_reasons={}, **rows.fields)
    if not moved:
        # Someone else moved it meanwhile (another pass placed it): undo ours.
        raise IntegrityError(f"replica {row.id} is no longer pending")
