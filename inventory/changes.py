"""The change feed: which nodes changed in ways placement cares about, in order.

The placement index is kept in memory by each process that plans (the
worker's reconciler, the web's dry runs) and reloads only what changed. This
module is how it learns what that is: every write of a fact placement reads
(registration, a state, labels, GPUs and their health, engine installs,
allocations, shard ports, the ports' physical fabric, power limits) calls
`mark(node_ids)`, which takes the next version of a counter in the cache and
stores the node ids under it. A reader asks for everything after the
version it last applied, in one round trip.

Anything a reader cannot be sure of reads as a gap, and a gap is a full
rebuild: the counter gone (a flushed cache), an entry expired, a version
taken whose entry is not written yet, the cache down. So the feed may lose
changes only to the reader's cost, never to its correctness, except for one
case written down here: a mark that fails to reach the cache while the reader
still reaches it. The reader's periodic full rebuild bounds that staleness.

A mark inside a transaction is published twice: at once, and again after the
commit. A reader that saw the first one before the commit reloaded the
node's old rows; the second makes it reload again once the new ones are
visible. One mark outside a transaction is enough.

Inventory does not import placement: holds and budgets (placement's models)
call `mark_all()`, which every reader takes as a full rebuild.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.cache import cache
from django.db import transaction

from inventory import doctor_view
from inventory.telemetry import best_effort

VERSION_KEY = "placement-feed:version"
ENTRY_PREFIX = "placement-feed:v:"
# Every node: a change no per-node reload can apply (holds, budgets).
ALL = "*"
# An entry that begins with this names nodes whose holdings alone changed (a shard's GPUs, memory,
# power and ports claimed or given back): a reader reloads those from three tables instead of
# every table and the telemetry. In a scale-up each worker process reloaded every node the other
# had claimed, whole, and that was seconds of its CPU at 10,000 nodes.
HOLDINGS = "#holdings"
# An entry outlives any reader's interval between passes many times over.
ENTRY_TTL_S = 3600
# Entries a reader fetches with the version in its one round trip.
PREFETCH = 32
# This thread's marks kept for published_here; older ones are simply reloaded by a reader.
LOG_KEPT = 256
# Beyond this many versions behind, a full rebuild is cheaper than the entries. A join storm of
# 10,000 nodes marks 20,000 (each registration twice): at 2,000 a reader whose full rebuild took
# longer than 2,000 marks (seconds, at that size) fell behind again while rebuilding and rebuilt on
# every pass, in the worker's reconciler and doctor alike, through the storm and the scale-up
# after it. 100,000 small entries are a few megabytes, read in FETCH_CHUNK-key round trips.
MAX_BEHIND = 100_000
FETCH_CHUNK = 10_000


# What this thread published, for a reader in the same thread that already
# applied those changes itself (the reconciler's own claims): see published_here.
_here = threading.local()


def _entry_key(version: int) -> str:
    return f"{ENTRY_PREFIX}{version}"


def _start() -> None:
    # The counter starts at a random base: after a flushed cache a reader
    # holding an old version can never mistake the new versions for its own.
    cache.add(VERSION_KEY, random.randrange(1, 1 << 40) << 20, timeout=None)


def _incr_then_set(ids: list[str]) -> int:
    # The project's caches take the next version and write its entry in one round trip
    # (a registration marks twice); another backend, in two.
    both = getattr(cache, "incr_then_set", None)
    if both is not None:
        return both(VERSION_KEY, ENTRY_PREFIX, ids, timeout=ENTRY_TTL_S)
    version = cache.incr(VERSION_KEY)
    cache.set(_entry_key(version), ids, timeout=ENTRY_TTL_S)
    return version


def _publish(ids: list[str], *, holdings: bool = False) -> None:
    entry = [HOLDINGS, *ids] if holdings else ids

    def write() -> None:
        try:
            version = _incr_then_set(entry)
        except ValueError:
            # No counter yet (or a flushed cache): one more round trip, once.
            _start()
            version = _incr_then_set(entry)
        log = getattr(_here, "log", None)
        if log is None:
            log = _here.log = []
        log.append((version, ids))
        if len(log) > LOG_KEPT:
            # A thread that marks and never reads (a web thread's heartbeats) must not grow it for ever.
            del log[:-LOG_KEPT]

    best_effort("feed_mark", write, None)


def mark(node_ids: Iterable[str], *, holdings: bool = False) -> None:
    """Record that these nodes changed in a way placement reads (after the commit too, when in one).

    `holdings`: only what the nodes' shards hold changed (allocations, their
    GPUs, shards' ports), nothing else of the nodes.
    """
    ids = sorted({str(i) for i in node_ids if i})
    if not ids:
        return
    _publish(ids, holdings=holdings)
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _publish(ids, holdings=holdings))


def published_here() -> list[tuple[int, list[str]]]:
    """The (version, node ids) this thread published since it last asked; the list is then emptied."""
    log = getattr(_here, "log", None) or []
    _here.log = []
    return log


def mark_all() -> None:
    """Record a change every node's placement record depends on (a hold, a power budget)."""
    mark([ALL])


@dataclass(frozen=True)
class Changes:
    """What changed after a reader's version: the new version and the node ids, or a gap."""

    version: int | None
    node_ids: frozenset[str] = frozenset()
    gap: bool = False
    # version -> the node ids marked under it.
    entries: Mapping[int, frozenset[str]] = field(default_factory=dict)
    # The versions whose marks named holdings only (mark(..., holdings=True)).
    holdings: frozenset[int] = frozenset()

    @property
    def everything(self) -> bool:
        """Whether the reader must rebuild everything (a gap, or a change to every node)."""
        return self.gap or ALL in self.node_ids


def current_version() -> int | None:
    """The feed's version now, started if need be (None: the cache is unreachable): where a full rebuild starts from."""

    def read() -> int | None:
        _start()
        return cache.get(VERSION_KEY)

    return best_effort("feed_read", read, None)


def since(version: int | None) -> Changes:
    """The nodes marked after `version`, in one cache round trip when few; a gap when unsure."""
    if version is None:
        return Changes(current_version(), gap=True)
    keys = [VERSION_KEY] + [_entry_key(v) for v in range(version + 1, version + 1 + PREFETCH)]
    found: dict[str, Any] | None = best_effort("feed_read", lambda: cache.get_many(keys), None)
    if found is None or found.get(VERSION_KEY) is None:
        return Changes(None, gap=True)
    now = int(found[VERSION_KEY])
    if now == version:
        return Changes(now)
    if now < version or now - version > MAX_BEHIND:
        return Changes(now, gap=True)
    for first in range(version + 1 + PREFETCH, now + 1, FETCH_CHUNK):
        rest = [_entry_key(v) for v in range(first, min(first + FETCH_CHUNK, now + 1))]
        more = best_effort("feed_read", lambda rest=rest: cache.get_many(rest), None)
        if more is None:
            return Changes(now, gap=True)
        found.update(more)
    entries: dict[int, frozenset[str]] = {}
    holdings: set[int] = set()
    for v in range(version + 1, now + 1):
        entry = found.get(_entry_key(v))
        if entry is None:
            # Expired, or taken and not written yet: unsure, so everything.
            return Changes(now, gap=True)
        if entry and entry[0] == HOLDINGS:
            holdings.add(v)
            entry = entry[1:]
        entries[v] = frozenset(entry)
    return Changes(now, frozenset().union(*entries.values()), entries=entries, holdings=frozenset(holdings))


def _placement_view(entry: Mapping[str, Any] | None) -> tuple:
    # What placement reads from telemetry: each port's physical fabric
    # (state, link layer, subnet managers, network), each card's power limit,
    # and the TCP ports listening on the node.
    if not entry:
        return ()
    ports = tuple(
        (p.get("hca"), p.get("port"), p.get("state"), p.get("link_layer"), p.get("sm_guid"), p.get("network"),
         repr(p.get("sms")))
        for p in entry.get("ib_ports") or []
        if isinstance(p, Mapping)
    )  # fmt: skip
    limits = tuple((g.get("index"), g.get("power_limit_w")) for g in entry.get("gpus") or [] if isinstance(g, Mapping))
    return ports, limits, tuple(entry.get("listening_ports") or ())


def mark_telemetry(node_id: str, previous: Mapping[str, Any] | None, entry: Mapping[str, Any]) -> bool:
    """Mark a node whose telemetry differs from the previous in what placement or the doctor reads; True when marked.

    Rates, counters, temperatures and draw change every heartbeat and are not
    placement's business; a port going down or a subnet-manager failover is.
    The doctor's incremental refresh reads the same feed, so what its checks
    read (inventory/doctor_view.py: error counters, wear, a skewed clock)
    marks the node too: rare, and placement reloads such a node for nothing.
    """
    if _placement_view(previous) == _placement_view(entry) and doctor_view.view(previous) == doctor_view.view(entry):
        return False
    mark([node_id])
    return True
