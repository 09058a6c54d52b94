"""What placing a replica writes, and the one writer of it: one placement, or a batch, in a few statements.

A placement's rows (its claims, shards, commands and the replica's move to
starting) are computed before anything is written, then written in three
statements whatever the number of placements: the replica's move (a
compare-and-set on the state it was read in, with its own reason, endpoint
and fabric), the allocations' ids drawn, and one insert of the allocations,
their GPUs, the shards, the commands and the events together. A placement
written this way alone costs no savepoint; the database's constraints still
decide (a GPU is held by one shard: AllocatedGPU's unique constraint).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

import llmgw_wire as wire
from inventory import changes, outbox, wakeups
from inventory.models import AllocatedGPU, Allocation, Command
from llmgw import db
from llmgw_wire import engines as wire_engines
from llmgw_wire import shard_states
from placement import planner
from placement.models import (
    REPLICA_TRANSITIONS,
    Deployment,
    EngineProfile,
    PlacementEvent,
    Replica,
    ReplicaState,
    Shard,
)
from placement.replicas import TransitionError, event_row
from placement.signals import replicas_changed
from placement.snapshot import Snapshot

RS = ReplicaState
# The replica fields a placement sets that differ replica by replica.
VARYING = ("reason", "nvlink_domain", "fabric", "fabric_name", "endpoint", "profile_fp")


@dataclass
class Placement:
    """One planned replica's rows, computed before any is written."""

    row: Replica
    plan: planner.Plan
    # (node id, shard id, sorted GPU indices, memory GB, cores, watts) per shard.
    claims: list[tuple[str, uuid.UUID, list[int], int, int, float]]
    # Each shard's row, as its columns (llmgw.db.insert_rows).
    shards: list[dict[str, Any]]
    # (node id, kind, payload, shard key) in the order they are queued: per shard an InstallEngine where asked,
    # then its StartShard.
    commands: list[tuple[str, str, dict[str, Any], str]]
    # The replica's fields as it moves to starting (VARYING).
    fields: dict[str, str]


def placement_rows(
    row: Replica, dep: Deployment, result: planner.Plan, snap: Snapshot, *, now: dt.datetime
) -> Placement:
    """The rows placing `row` as `result` writes; raises on a move its state never allows or a profile the
    wire cannot carry."""
    if RS.STARTING not in REPLICA_TRANSITIONS[RS(row.state)]:
        raise TransitionError(f"a replica cannot go from {row.state} to {RS.STARTING}")
    profile = dep.profile
    fp = profile.fingerprint()
    leader = result.shards[0]
    leader_addr = snap.nodes[leader.node_id].mgmt_addr
    wire_profile = wire.EngineProfile(
        name=profile.name,
        engine=profile.engine,
        gpu_class=profile.gpu_class,
        tp=profile.tp,
        pp=profile.pp,
        gpus_per_node=profile.gpus_per_node,
        nodes=profile.nodes,
        args=list(profile.args or []),
        env={**(profile.env or {}), **result.env},
        model_path=profile.model_path,
        served_model_name=profile.served_model_name or dep.served_model,
    )
    out = Placement(row, result, [], [], [], {})
    for s in result.shards:
        shard_id = uuid.uuid4()
        out.claims.append((s.node_id, shard_id, sorted(set(s.gpu_indices)), s.memory_gb, s.cpu_cores, s.power_w))
        out.shards.append(
            {
                "id": shard_id,
                "replica_id": row.id,
                "node_id": s.node_id,
                "rank": s.rank,
                "gpu_indices": list(s.gpu_indices),
                "hcas": list(s.hcas),
                "http_port": s.http_port,
                "ports_after": s.ports_after,
                "rendezvous_port": s.leader_port or None,
                "state": shard_states.S.PENDING,
                "profile_fp": fp,
                "created_at": now,
                "updated_at": now,
            }
        )
    for s, shard in zip(result.shards, out.shards, strict=True):
        if s.install_engine:
            out.commands.append((s.node_id, *outbox.columns(_install(profile))))
        start = wire.StartShard(
            replica_id=str(row.id),
            shard_id=str(shard["id"]),
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
        out.commands.append((s.node_id, *outbox.columns(start)))
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


def write(batch: list[Placement], *, now: dt.datetime) -> tuple[list[Placement], list[Placement]]:
    """Write placements in the caller's transaction: (written, gone).

    `gone`: replicas no longer in the state they were read in (another pass
    placed or retired them): nothing of theirs is written. Raises
    IntegrityError when a claim collides with one already committed.
    """
    if not batch:
        return [], []
    if len(batch) == 1:
        # One row: the compare-and-set is its own lock, and there is no order to keep.
        written = batch if _move(batch, now=now) == 1 else []
    else:
        # Locked in id order, as replicas.move does, so concurrent writers queue instead of deadlocking.
        locked = dict(
            Replica.objects.select_for_update()
            .filter(id__in=[p.row.id for p in batch])
            .order_by("id")
            .values_list("id", "state")
        )
        written = [p for p in batch if locked.get(p.row.id) == p.row.state]
        if written:
            _move(written, now=now)
    done = {id(p) for p in written}
    gone = [p for p in batch if id(p) not in done]
    if not written:
        return [], gone
    # Five tables in one statement of one JSON document each, and no model instance per row: through the
    # ORM these inserts were most of a thousand-replica pass (llmgw.db.insert_rows). The allocations' ids
    # are drawn first, so that their GPUs can name them in the same statement.
    claims = [(p.row.id, c) for p in written for c in p.claims]
    alloc_ids = db.reserve_ids(Allocation, len(claims))
    allocs, gpus = [], []
    for (replica_id, (node_id, shard_id, held, mem, cores, watts)), alloc_id in zip(claims, alloc_ids, strict=True):
        allocs.append(
            {
                "id": alloc_id,
                "node_id": node_id,
                "replica_id": replica_id,
                "shard_id": shard_id,
                "memory_gb": mem,
                "cpu_cores": cores,
                "power_w": watts,
            }
        )
        gpus += [{"allocation_id": alloc_id, "node_id": node_id, "gpu_index": g} for g in held]
    db.insert_rows(
        [
            (Allocation, allocs),
            (AllocatedGPU, gpus),
            (Shard, [s for p in written for s in p.shards]),
            (
                Command,
                [
                    {"node_id": node_id, "kind": kind, "payload": payload, "created_at": now, "shard_id": key}
                    for p in written
                    for node_id, kind, payload, key in p.commands
                ],
            ),
            (
                PlacementEvent,
                [
                    event_row(
                        "state",
                        now=now,
                        deployment_id=p.row.deployment_id,
                        replica_id=p.row.id,
                        from_state=p.row.state,
                        to_state=RS.STARTING,
                        reason=p.fields["reason"],
                    )
                    for p in written
                ],
            ),
        ]
    )
    # The agents' long-polls answer once this commits, and other processes'
    # kept placement indexes reload these nodes.
    for node_id in sorted({node_id for p in written for node_id, *_ in p.commands}):
        wakeups.publish_on_commit(node_id)
    changes.mark((a["node_id"] for a in allocs), holdings=True)
    ids = [p.row.id for p in written]
    # Routers see the new replicas as soon as they are committed.
    transaction.on_commit(lambda: replicas_changed.send(sender=Replica, replica_ids=ids))
    return written, gone


def _move(placements: list[Placement], *, now: dt.datetime) -> int:
    """Each replica to starting, from the state it was read in, with its own reason, endpoint and fabric:
    one UPDATE, from the rows as one JSON document on PostgreSQL and from a VALUES list per chunk
    elsewhere; returns the rows moved.

    Django's bulk_update builds a CASE per field and row: for 250 replicas
    that took longer in Python than every insert of the batch together.
    """
    qn = connection.ops.quote_name
    meta = Replica._meta
    fields = [meta.get_field(n) for n in VARYING]
    state, updated_at, pending = (meta.get_field(n) for n in ("state", "updated_at", "pending_reasons"))
    table, pk = qn(meta.db_table), qn(meta.pk.column)
    sets = ", ".join(
        [f"{qn(state.column)} = %s", f"{qn(updated_at.column)} = %s", f"{qn(pending.column)} = %s"]
        + [f"{qn(f.column)} = v.{qn(f.column)}" for f in fields]
    )
    constants = [
        state.get_db_prep_save(RS.STARTING, connection),
        updated_at.get_db_prep_save(now, connection),
        pending.get_db_prep_save({}, connection),
    ]
    if connection.vendor == "postgresql":
        # The rows as one JSON document read into the table's row type, as db.insert_rows writes: a VALUES
        # list of 250 rows was 2,000 parameters that psycopg split out of the statement and quoted in Python,
        # half the batch's time in the writer.
        rows = [
            {meta.pk.column: p.row.id, state.column: p.row.state}
            | {f.column: f.get_db_prep_save(p.fields[f.name], connection) for f in fields}
            for p in placements
        ]
        sql = (
            f"UPDATE {table} SET {sets} FROM jsonb_populate_recordset(NULL::{table}, %s::jsonb) AS v "
            f"WHERE {table}.{pk} = v.{pk} AND {table}.{qn(state.column)} = v.{qn(state.column)}"
        )
        with db.prepared_cursor() as cur:
            cur.execute(sql, [*constants, db.json_rows(rows)])
            return cur.rowcount
    # VALUES names its columns column1, column2, ...; the statement starts with UPDATE, not WITH, so
    # that SQLite counts the rows it changed.
    names = ("pk", "was", *(f.column for f in fields))
    cols = ", ".join(f"column{i} AS {qn(c)}" for i, c in enumerate(names, 1))
    width = len(names)
    # SQLite counts bound parameters per statement.
    per = max(1, (connection.features.max_query_params or 10_000) // width - 1)
    moved = 0
    for start in range(0, len(placements), per):
        chunk = placements[start : start + per]
        params: list[Any] = []
        for p in chunk:
            params += [meta.pk.get_db_prep_value(p.row.id, connection), p.row.state]
            params += [f.get_db_prep_save(p.fields[f.name], connection) for f in fields]
        values = ", ".join(["(" + ", ".join(["%s"] * width) + ")"] * len(chunk))
        sql = (
            f"UPDATE {table} SET {sets} FROM (SELECT {cols} FROM (VALUES {values}) AS x) AS v "
            f"WHERE {table}.{pk} = v.{qn('pk')} AND {table}.{qn(state.column)} = v.{qn('was')}"
        )
        with connection.cursor() as cur:
            cur.execute(sql, constants + params)
            moved += cur.rowcount
    return moved


def _install(profile: EngineProfile) -> wire.InstallEngine:
    """The InstallEngine a node without the profile's engine is sent, under the engine's canonical name."""
    return wire.InstallEngine(engine=wire_engines.get(profile.engine).name, version=profile.engine_version)
