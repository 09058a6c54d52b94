"""What a heartbeat changes in the inventory, at a small constant cost.

A heartbeat arrives every few seconds from every node, so its cost is the
control plane's scaling limit. The lease (last_seen) is one UPDATE that also
returns what the rest needs; everything momentary goes to the cache; durable
facts (GPU fabric state, engine installs, IMEX) are written only when they
differ from what was last applied, which the cache remembers, so a
steady-state heartbeat writes one row.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import connection

import llmgw_wire as wire
from inventory import changes
from inventory import fabric as fabric_rules
from inventory import gpus as gpu_rules
from inventory.models import GPU, Command, EngineInstall, Node, NodeState
from inventory.nodes import change_state, record_event
from llmgw.db import prepared_cursor

# Cumulative byte counters and the bytes each unit counts. sysfs's
# port_xmit_data / port_rcv_data count 4-octet words (InfiniBand spec).
TX_COUNTERS = (("port_xmit_data", 4), ("tx_bytes", 1))
RX_COUNTERS = (("port_rcv_data", 4), ("rx_bytes", 1))


@dataclass(frozen=True)
class Touched:
    """A node's row as a heartbeat left it."""

    state: str
    imex_state: str
    imex_channels: int
    nvlink_domain: str
    # Whether it had unacknowledged commands as the lease was renewed (True when not read): a status
    # of a node with none skips the outbox's read, most statuses of a large fleet.
    waiting: bool = True


def _relax(durable: bool) -> list[str]:
    # A FROM item of the UPDATE itself: a separate SET LOCAL would cost a round trip.
    if not durable and connection.vendor == "postgresql":
        return ["(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit"]
    return []


def _touched(node_id: str, row: tuple, *, now: dt.datetime) -> Touched:
    state = row[0]
    if state in (NodeState.UNREACHABLE, NodeState.LOST) and change_state(
        node_id, NodeState.READY, now=now, expected=state, reason="heartbeat resumed", actor_name="agent"
    ):
        state = NodeState.READY
    waiting = bool(row[4]) if len(row) > 4 else True
    return Touched(state=state, imex_state=row[1], imex_channels=row[2], nvlink_domain=row[3], waiting=waiting)


def touch(node_id: str, *, now: dt.datetime, durable: bool = True) -> Touched | None:
    """Renew a node's lease and bring an unreachable or lost node back to ready.

    One statement renews the lease and returns the row, so the caller needs no
    other read. Cordoned and draining are the operator's and stay. None for a
    node that does not exist.

    durable=False (PostgreSQL only) lets the surrounding transaction commit
    without waiting for its WAL to reach the disk. A heartbeat is the place
    for it: everything it writes is sent again a few seconds later, so a
    database crash can cost at most the last fraction of a second of
    heartbeats (the commits are lost whole, never half-applied), while every
    heartbeat saves a disk flush: about half of PostgreSQL's work per
    heartbeat, and its longest wait.
    """
    relax = _relax(durable)
    from_items = f"FROM {', '.join(relax)} " if relax else ""
    with prepared_cursor() as cur:
        cur.execute(
            f"UPDATE {Node._meta.db_table} SET last_seen = %s, unreachable_since = NULL {from_items}WHERE id = %s "
            "RETURNING state, imex_state, imex_channels, nvlink_domain",
            [now, node_id],
        )
        row = cur.fetchone()
    if row is None:
        return None
    return _touched(node_id, row, now=now)


@dataclass(frozen=True)
class NodeLookup:
    """A row of another table that names a node (its `node_id` column), found by `where` over alias `c`.

    Lets the app above (agents, for a node credential) find the node a
    heartbeat speaks for in the lease renewal's own statement, without
    inventory knowing that table.
    """

    table: str
    where: str
    params: tuple
    # Returned, in this order; `node_id` first.
    columns: tuple[str, ...]


def touch_found(lookup: NodeLookup, *, now: dt.datetime, durable: bool = True) -> tuple[tuple, Touched] | None:
    """touch() for the node `lookup` finds, in the same statement.

    A heartbeat's authentication and its lease renewal are then one round
    trip. Returns the looked-up row's columns and the touched node; None when
    no row matches. The caller decides what the row allows, and rolls the
    lease back when it refuses the request.
    """
    if connection.vendor != "postgresql":
        return _touch_found_portable(lookup, now=now)
    from_items = ", ".join([f"{lookup.table} AS c", *_relax(durable)])
    returning = ", ".join(f"c.{col}" for col in lookup.columns)
    with prepared_cursor() as cur:
        cur.execute(
            f"UPDATE {Node._meta.db_table} AS n SET last_seen = %s, unreachable_since = NULL FROM {from_items} "
            f"WHERE ({lookup.where}) AND n.id = c.node_id "
            f"RETURNING {returning}, n.state, n.imex_state, n.imex_channels, n.nvlink_domain, "
            f"EXISTS (SELECT 1 FROM {Command._meta.db_table} AS m WHERE m.node_id = n.id AND m.acked_at IS NULL)",
            [now, *lookup.params],
        )
        row = cur.fetchone()
    if row is None:
        return None
    width = len(lookup.columns)
    return tuple(row[:width]), _touched(row[0], row[width:], now=now)


def _touch_found_portable(lookup: NodeLookup, *, now: dt.datetime) -> tuple[tuple, Touched] | None:
    # SQLite's RETURNING may name only the updated table, never one of the
    # FROM clause ("no such column: c.node_id"): the embedded default answered
    # every heartbeat with a 500. It has no network round trip to spare, so
    # the row is read first and the lease renewed by touch().
    with prepared_cursor() as cur:
        cur.execute(
            f"SELECT {', '.join(lookup.columns)} FROM {lookup.table} AS c WHERE {lookup.where} LIMIT 1",
            list(lookup.params),
        )
        found = cur.fetchone()
    if found is None:
        return None
    touched = touch(found[0], now=now)
    if touched is None:
        return None
    return tuple(found), touched


def port_key(port: Any) -> str:
    """A port's name within its node: "mlx5_0/1"."""
    return f"{port.hca}/{port.port}"


def _counter(counters: Mapping[str, int], names: tuple[tuple[str, int], ...]) -> int | None:
    for name, unit in names:
        if name in counters:
            return counters[name] * unit
    return None


def _rate(now_value: int | None, before: int | None, seconds: float) -> float:
    # A counter that went backwards was reset (driver reload, reboot): no rate
    # is better than a huge negative one.
    if now_value is None or before is None or seconds <= 0 or now_value < before:
        return 0.0
    return (now_value - before) * 8 / seconds


def telemetry(hb: wire.Heartbeat, previous: Mapping[str, Any] | None, *, now: dt.datetime) -> dict[str, Any]:
    """The cache entry for a heartbeat, with port rates from the counters' change since the previous one.

    Rates are zero on the first heartbeat and after a counter reset. The
    interval is the agent's own clock when both heartbeats carry it (the
    network's jitter is not the port's), else the server's.
    """
    server_at = now.timestamp()
    prev_ports: dict[str, Mapping[str, Any]] = {}
    interval = 0.0
    if previous:
        prev_ports = {f"{p['hca']}/{p['port']}": p for p in previous.get("ib_ports") or []}
        if hb.at is not None and previous.get("agent_at") is not None:
            interval = hb.at - previous["agent_at"]
        else:
            interval = server_at - (previous.get("at") or server_at)
    # One serialisation of the whole report: per-card and per-port dumps cost
    # more than the rest of this function.
    dumped = hb.model_dump(mode="json", include={"load", "gpus", "ib_ports"})
    ports = dumped["ib_ports"] or []
    for p, d in zip(hb.ib_ports or [], ports, strict=True):
        before = prev_ports.get(port_key(p))
        before_counters = before.get("counters") or {} if before else {}
        d["tx_bps"] = _rate(_counter(p.counters, TX_COUNTERS), _counter(before_counters, TX_COUNTERS), interval)
        d["rx_bps"] = _rate(_counter(p.counters, RX_COUNTERS), _counter(before_counters, RX_COUNTERS), interval)
    return {
        "at": server_at,
        "agent_at": hb.at,
        "load": dumped["load"],
        "gpus": dumped["gpus"] or [],
        "ib_ports": ports,
        "shards": [{"shard_id": s.shard_id, "state": str(s.state)} for s in hb.shards],
        # What listens on the node: the planner hands out no shard port among them.
        "listening_ports": hb.listening_ports,
    }


def record_sm_changes(
    node_id: str, ports: Iterable[Any], previous: Mapping[str, Any] | None, *, now: dt.datetime
) -> int:
    """Record each port now seeing a different master subnet manager than at the previous heartbeat.

    A port going down (no master) is not a change of master; a failover is.
    """
    if not previous:
        return 0
    before = {f"{p['hca']}/{p['port']}": p.get("sm_guid") or "" for p in previous.get("ib_ports") or []}
    changed = 0
    for p in ports:
        raw_old = before.get(port_key(p), "")
        if raw_old == p.sm_guid:
            # The usual case, and no change whatever the spelling.
            continue
        old = fabric_rules.canonical_guid(raw_old)
        new = fabric_rules.canonical_guid(p.sm_guid)
        if old and new and old != new:
            fabric_rules.record_sm_change(at=now, node_id=node_id, port=port_key(p), from_guid=old, to_guid=new)
            changed += 1
    return changed


def status_digest(body: bytes) -> str:
    """The digest of a status as it arrived (its bytes): what the agent's floor sends back instead of it.

    Of the bytes, not of the parsed report: hashing a 9 KB status costs
    microseconds, where serialising it again would cost as much as parsing
    it. Every status carries the agent's clock, so no two are alike.
    """
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def digest(items: Iterable[wire.Message]) -> str:
    """A short fingerprint of a report, to skip writing what was already applied."""
    h = hashlib.blake2b(digest_size=12)
    for i in items:
        h.update(i.model_dump_json().encode())
        h.update(b"\x00")
    return h.hexdigest()


def apply_gpu_fabrics(
    node_id: str, reports: Iterable[wire.GPUFabricReport], *, current_domain: str, now: dt.datetime
) -> str:
    """Update the cards' NVLink fabric state and the node's domain; returns the domain.

    A fabric-manager restart drops every card at once, which is why the agent
    re-reads this once a minute. Cards the agent did not report keep their
    state; a report for a card the inventory lacks is ignored (registration
    owns the list of cards).
    """
    rows = list(
        GPU.objects.filter(node_id=node_id).only(
            "id",
            "index",
            "fabric_state",
            "fabric_status",
            "cluster_uuid",
            "clique_id",
            "fabric_bandwidth",
            "fabric_health",
        )
    )
    by_index = {g.index: g for g in rows}
    changed = False
    for r in reports:
        row = by_index.get(r.index)
        if row is None:
            continue
        f = r.fabric
        values = {
            "fabric_state": f.state if f else "",
            "fabric_status": f.status if f else "",
            "cluster_uuid": f.cluster_uuid if f else "",
            "clique_id": f.clique_id if f else "",
            "fabric_bandwidth": f.bandwidth if f else "",
            "fabric_health": f.health if f else "",
        }
        if any(getattr(row, k) != v for k, v in values.items()):
            for k, v in values.items():
                setattr(row, k, v)
            GPU.objects.filter(pk=row.pk).update(**values)
            changed = True
    domain = gpu_rules.node_domain(rows)
    if changed or domain != current_domain:
        # Only a change: every node's first fabric report after it joins repeats what its
        # registration wrote, and marking each had ten thousand nodes reloaded for nothing.
        changes.mark([node_id])
    if domain != current_domain:
        Node.objects.filter(id=node_id).update(nvlink_domain=domain)
        record_event(
            node_id,
            "nvlink",
            f"NVLink domain {current_domain or '(none)'} -> {domain or '(none)'}",
            now=now,
            actor_name="agent",
            data={"from": current_domain, "to": domain},
        )
    return domain


def apply_engine_installs(node_id: str, installs: Iterable[wire.EngineInstall]) -> int:
    """Record where each engine's installation stands; returns the rows written.

    Only differences are written; an engine the agent no longer lists is forgotten.
    """
    wanted = {i.engine: i for i in installs}
    existing = {e.engine: e for e in EngineInstall.objects.filter(node_id=node_id)}
    written = 0
    gone = set(existing) - set(wanted)
    if gone:
        written += EngineInstall.objects.filter(node_id=node_id, engine__in=gone).delete()[0]
    for engine, i in wanted.items():
        values = {"version": i.version, "variant": i.variant, "state": i.state, "detail": i.detail}
        row = existing.get(engine)
        if row is None:
            EngineInstall.objects.create(node_id=node_id, engine=engine, **values)
            written += 1
        elif any(getattr(row, k) != v for k, v in values.items()):
            for k, v in values.items():
                setattr(row, k, v)
            row.save(update_fields=[*values, "updated_at"])
            written += 1
    if written:
        changes.mark([node_id])
    return written


def apply_imex(node_id: str, imex: wire.IMEX, *, touched: Touched, now: dt.datetime) -> bool:
    """Record a change of nvidia-imex state or channels; False when nothing changed."""
    if imex.state == touched.imex_state and imex.channels == touched.imex_channels:
        return False
    Node.objects.filter(id=node_id).update(imex_state=imex.state, imex_channels=imex.channels)
    changes.mark([node_id])
    record_event(
        node_id,
        "imex",
        f"IMEX {touched.imex_state or '(unknown)'} -> {imex.state or '(unknown)'}, channels {imex.channels}",
        now=now,
        actor_name="agent",
        data={"state": imex.state, "channels": imex.channels},
    )
    return True
