"""The placement index kept in memory, brought up to date from the change feed instead of rebuilt.

A full build reads and parses every node (2-3 s at 5,000 nodes, 5.6 s at
10,000), and the reconciler used to pay it on every pass with pending work,
every dry run on every request. Here each process keeps one snapshot and
asks the change feed (inventory/changes.py) what changed since the version
it applied: usually nothing (one cache round trip) or a few nodes, reloaded
alone with the loader a full build uses (placement/snapshot_db.py), so a
reloaded node is exactly what a build would make of it. The lease is the one
fact that changes without a write worth marking (every heartbeat renews it):
one query of the nodes now past it keeps `silent_s` right.

A worker process builds its index as it starts and keeps it current every
LLMGW_KEPT_REFRESH_S seconds (default 2) in a thread of its own, so whichever
of the worker's processes takes a pass finds the index up to date: Celery
hands tasks to the first idle process, so one process ran the passes while
the other's index, last brought up to date before a join storm, reloaded
ten thousand nodes in the first pass of the next scale-up that reached it
(see `connect_worker_warmup`).

A full rebuild is the fallback: on first use, on a gap in the feed, on a
change to holds or budgets, when the feed names more than half of the nodes
(a rebuild reads them faster than a reload names them), when the settings it
was built under change, and every LLMGW_KEPT_REBUILD_S seconds (default 300)
as a safety net against a change whose mark never reached the cache.

The planner's claims (`Snapshot.reserve`, after the reconciler's write) go
into the kept snapshot, and the feed's marks of that write are taken as
applied, so the next pass does not reload the nodes it placed on; a mark
from anyone else, for the same nodes too, is reloaded. (A reservation also
counts a multi-node replica's leader port as used, which the database's
shard rows do not list: conservative, and gone at the next reload.) Whoever
plans what it will not write (a dry run) plans on `scratch()`, a copy.

The momentary draw (`NodeInfo.power_draw_w`) is the node's at its last
reload: it is shown to operators, budgets count claims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

from celery import signals as celery_signals
from celery.concurrency.prefork import TaskPool as PreforkPool
from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.db.models.signals import post_delete, post_save
from django.utils import timezone

from inventory import changes
from inventory.models import Node
from placement import snapshot_db
from placement.models import Hold, PowerBudget
from placement.planner import Plan
from placement.snapshot import HoldInfo, NodeInfo, Snapshot
from placement.snapshot_db import NodeFacts

log = logging.getLogger(__name__)

DEFAULT_REBUILD_S = 300.0
DEFAULT_REFRESH_S = 2.0
# A feed naming more nodes than this and than half the index is a rebuild, not a reload.
REBUILD_PAST = 1000


def _config() -> tuple:
    return (
        settings.LLMGW_SHARD_PORTS_UNIQUE,
        settings.LLMGW_SHARD_PORT_BASE,
        settings.LLMGW_UNREACHABLE_AFTER,
    )


def rebuild_interval_s() -> float:
    """Seconds between full rebuilds when the feed says nothing (the safety net)."""
    return float(getattr(settings, "LLMGW_KEPT_REBUILD_S", DEFAULT_REBUILD_S))


def refresh_interval_s() -> float:
    """Seconds between a worker process's background updates of its index (LLMGW_KEPT_REFRESH_S)."""
    return float(getattr(settings, "LLMGW_KEPT_REFRESH_S", DEFAULT_REFRESH_S))


class KeptIndex:
    """One process's kept snapshot and what it needs to apply changes to it."""

    def __init__(self) -> None:
        self.snap: Snapshot | None = None
        self.version: int | None = None
        self.facts: dict[str, NodeFacts] = {}
        self.holds: list[HoldInfo] = []
        self.pairs: Counter = Counter()
        self.canon: dict[str, str] = {}
        self.silent: set[str] = set()
        self.by_addr: dict[str, set[str]] = defaultdict(set)
        self.config: tuple = ()
        # Feed versions of this index's own claims (see applied).
        self.own: set[int] = set()
        self.built_at = 0.0
        # What happened, for the tests and the benchmark.
        self.rebuilds = 0
        self.reloaded = 0
        self.reloaded_holdings = 0
        # Reentrant: a pass holds it for its whole planning (planning()) and brings the index up to
        # date, and reserves in it, under it.
        self.lock = threading.RLock()

    # -- reading -------------------------------------------------------------
    def current(self, *, now: dt.datetime, rebuild: bool = False) -> Snapshot:
        """The snapshot, brought up to date: reloads what the feed names, or rebuilds when it must."""
        with self.lock:
            if (
                rebuild
                or self.snap is None
                or self.config != _config()
                or time.monotonic() - self.built_at > rebuild_interval_s()
            ):
                return self._rebuild(now)
            # What this thread marked before now was not applied here: it is read from the feed.
            changes.published_here()
            feed = changes.since(self.version)
            if feed.everything:
                return self._rebuild(now)
            # The claims this index reserved itself are applied already.
            ids: set[str] = set()
            held: set[str] = set()
            for v, marked in feed.entries.items():
                if v not in self.own:
                    (held if v in feed.holdings else ids).update(marked)
            self.own = {v for v in self.own if v > (feed.version or 0)}
            # A node this index does not know yet is read whole.
            held -= ids
            ids |= held - self.facts.keys()
            held &= self.facts.keys()
            if len(ids) + len(held) > max(REBUILD_PAST, len(self.facts) // 2):
                return self._rebuild(now)
            if ids:
                self._reload(ids)
            if held:
                self._reload_holdings(held)
            self.version = feed.version
            self._refresh_silence(now)
            return self.snap

    @contextlib.contextmanager
    def planning(self, *, now: dt.datetime) -> Iterator[Snapshot]:
        """The snapshot brought up to date, held for one pass's planning and writing.

        No other thread of the process (the keeper, warm()) updates it meanwhile. A plan is reserved
        in the snapshot before its batch is written, and a node reloaded between the two came back
        as the database had it, without the claims of the batch not yet written: the next plan on
        that node took the same port as an earlier one of its batch, which the database refused
        (placement_shard_live_port_unique), and the pass wrote the batch one placement at a time and
        left two replicas to a pass seconds later (1,000 replicas placed in 2.5-3.7 s instead of 1.3-2.0).
        """
        with self.lock:
            yield self.current(now=now)

    def scratch(self, *, now: dt.datetime) -> Snapshot:
        """An up-to-date copy to plan on without writing (a dry run reserves its plans)."""
        snap = self.current(now=now)
        with self.lock:
            return copy_snapshot(snap)

    def applied(self, snap: Snapshot, plan: Plan) -> None:
        """A plan this thread wrote was reserved in the kept snapshot: its marks need no reload.

        Only marks naming nothing but the plan's nodes count as its own; any
        other (another writer, this thread's other changes) is reloaded.
        """
        nodes = {s.node_id for s in plan.shards}
        with self.lock:
            if snap is not self.snap:
                # A snapshot since replaced by a rebuild: its writes are read from the feed.
                return
            self.own.update(v for v, ids in changes.published_here() if set(ids) <= nodes)
            for s in plan.shards:
                # The facts follow the claim, so what is redone from them later keeps it.
                f, n = self.facts.get(s.node_id), snap.nodes.get(s.node_id)
                if f is not None and n is not None:
                    base = dataclasses.replace(n, held="", fabrics=(), silent_s=0)
                    self.facts[s.node_id] = dataclasses.replace(f, base=base, power_claimed=f.power_claimed + s.power_w)

    # -- changing ------------------------------------------------------------
    def _rebuild(self, now: dt.datetime) -> Snapshot:
        # The version first: whatever is marked from here on is applied next time.
        changes.published_here()
        self.own = set()
        version = changes.current_version()
        self.config = _config()
        self.facts = snapshot_db.load(None)
        self.holds, budgets = snapshot_db.holds_and_budgets()
        self.pairs = Counter(p for f in self.facts.values() for p in f.sm_pairs)
        self.canon = snapshot_db.canon_of(self.pairs)
        self.snap = snapshot_db.assemble(
            self.facts, self.holds, budgets, unique_ports=self.config[0], now=now, canon=self.canon, cls=KeptSnapshot
        )
        object.__setattr__(self.snap, "owner", self)
        self.silent = {i for i, n in self.snap.nodes.items() if n.silent_s}
        self.by_addr = defaultdict(set)
        for i, n in self.snap.nodes.items():
            if n.mgmt_addr:
                self.by_addr[n.mgmt_addr].add(i)
        self.version = version
        self.built_at = time.monotonic()
        self.rebuilds += 1
        return self.snap

    def _reload(self, node_ids: Iterable[str]) -> None:
        snap = self.snap
        assert snap is not None
        ids = sorted(node_ids)
        fresh = snapshot_db.load(ids)
        self.reloaded += len(ids)
        addrs: set[str] = set()
        pairs_moved = False
        for i in ids:
            old, new = self.facts.pop(i, None), fresh.get(i)
            if old is not None:
                self.pairs.subtract(old.sm_pairs)
                self.by_addr[old.base.mgmt_addr].discard(i)
                addrs.add(old.base.mgmt_addr)
                gone = snap.nodes.pop(i, None)
                if gone is not None:
                    # Out of the index buckets before the record goes (Snapshot has no public removal).
                    snap._remove(gone)
            if new is not None:
                self.facts[i] = new
                self.pairs.update(new.sm_pairs)
                self.by_addr[new.base.mgmt_addr].add(i)
                addrs.add(new.base.mgmt_addr)
            pairs_moved = pairs_moved or (old.sm_pairs if old else frozenset()) != (
                new.sm_pairs if new else frozenset()
            )
            self.silent.discard(i)
        redo: Iterable[str] = [i for i in ids if i in fresh]
        if pairs_moved:
            self.pairs = +self.pairs
            canon = snapshot_db.canon_of(self.pairs)
            if canon != self.canon:
                # A subnet manager joined or left a fabric: every node's keys may read differently.
                self.canon = canon
                redo = list(self.facts)
        self._redo(redo, addrs)

    def _reload_holdings(self, node_ids: Iterable[str]) -> None:
        # Nodes whose shards' holdings alone changed (another process's claims and releases).
        ids = sorted(node_ids)
        self.facts.update(snapshot_db.reload_holdings({i: self.facts[i] for i in ids}))
        self.reloaded_holdings += len(ids)
        self.silent.difference_update(ids)
        self._redo(ids, {self.facts[i].base.mgmt_addr for i in ids})

    def _redo(self, redo: Iterable[str], addrs: set[str]) -> None:
        # The records of `redo` made again from their facts, and what the cluster sums of them.
        snap = self.snap
        assert snap is not None
        lease = settings.LLMGW_UNREACHABLE_AFTER
        for i in redo:
            # The lease is applied by _refresh_silence, from one query for every node.
            snap.replace(
                snapshot_db.node_info(self.facts[i], canon=self.canon, holds=self.holds, now=None, lease=lease)
            )
        for addr in addrs - {""}:
            at = self.by_addr.get(addr)
            if at:
                snap.host_ports[addr] = {p for n in at for p in snap.nodes[n].ports | snap.nodes[n].busy_ports}
            else:
                snap.host_ports.pop(addr, None)
                self.by_addr.pop(addr, None)
        if snap.cluster_ports is not None:
            snap.cluster_ports.clear()
            snap.cluster_ports.update(p for n in snap.nodes.values() for p in n.ports)
        if snap.budgets:
            snap.budget_used.clear()
            for i, f in self.facts.items():
                if f.power_claimed:
                    snap.claim_power(snap.nodes[i], f.power_claimed)

    def _refresh_silence(self, now: dt.datetime) -> None:
        # One query, of the few nodes past their lease: a renewed lease is not marked in the feed.
        snap = self.snap
        assert snap is not None
        lease = settings.LLMGW_UNREACHABLE_AFTER
        cutoff = now - dt.timedelta(seconds=lease)
        rows = Node.objects.filter(Q(last_seen__lt=cutoff) | Q(last_seen__isnull=True)).values_list("id", "last_seen")
        silent: set[str] = set()
        for node_id, last_seen in rows:
            n = snap.nodes.get(node_id)
            if n is None:
                continue
            s = snapshot_db.silent_s(last_seen, now=now, lease=lease)
            if s:
                silent.add(node_id)
            if n.silent_s != s:
                snap.replace(_with_silence(n, s))
        for node_id in self.silent - silent:
            n = snap.nodes.get(node_id)
            if n is not None and n.silent_s:
                snap.replace(_with_silence(n, 0))
        self.silent = silent


def _with_silence(n: NodeInfo, s: int) -> NodeInfo:
    return dataclasses.replace(n, silent_s=s)


class ScratchSnapshot(Snapshot):
    """A snapshot that shares its index with copies until it writes to it (copy on write, slot by slot).

    Copying the whole index at 10,000 nodes (a thousand slots of sorted
    lists) cost more than the dry run's planning; a reservation touches the
    few slots of the nodes it claims on. Both sides copy before writing: the
    copy (a dry run reserving) and the kept original (the next update, while
    a dry run in another thread still plans on the copy).
    """

    # The slots this snapshot has its own copy of; None: all of them (nothing shared).
    _owned: set | None

    def _own(self, n: NodeInfo) -> None:
        owned = getattr(self, "_owned", None)
        if owned is None:
            return
        for slot, _ in self._slots(n):
            if slot not in owned:
                owned.add(slot)
                self._index[slot] = {c: ids.copy() for c, ids in self._index.get(slot, {}).items()}

    def _add(self, n: NodeInfo) -> None:
        self._own(n)
        super()._add(n)

    def _remove(self, n: NodeInfo) -> None:
        self._own(n)
        super()._remove(n)

    def reserve(self, plan: Plan) -> None:
        """Count a plan's claims in this snapshot only."""
        for s in plan.shards:
            addr = self.nodes[s.node_id].mgmt_addr
            if addr:
                # The sets are the original's until written.
                self.host_ports[addr] = set(self.host_ports.get(addr, ()))
        super().reserve(plan)


def copy_snapshot(snap: Snapshot) -> Snapshot:
    """A copy that planning and reserving leave the original untouched by (records are frozen, shared)."""
    out = ScratchSnapshot(
        nodes={},
        budgets=snap.budgets,
        budget_used=dict(snap.budget_used),
        port_base=snap.port_base,
        cluster_ports=None if snap.cluster_ports is None else set(snap.cluster_ports),
        host_ports=dict(snap.host_ports),
    )
    object.__setattr__(out, "_owned", set())
    out.nodes.update(snap.nodes)
    out._index.update(snap._index)
    if isinstance(snap, ScratchSnapshot):
        # The original shares its lists now: its next write copies first.
        object.__setattr__(snap, "_owned", set())
    return out


class KeptSnapshot(ScratchSnapshot):
    """The kept snapshot: a reservation in it (the reconciler's, after its write) tells its index."""

    owner: KeptIndex

    def reserve(self, plan: Plan) -> None:
        """Count a plan's claims, and take the feed's marks of its write as applied."""
        super().reserve(plan)
        self.owner.applied(self, plan)


_kept = KeptIndex()


def current(*, now: dt.datetime, rebuild: bool = False) -> Snapshot:
    """This process's kept snapshot, up to date as of the feed and the lease at `now` (see KeptIndex)."""
    return _kept.current(now=now, rebuild=rebuild)


def planning(*, now: dt.datetime) -> contextlib.AbstractContextManager[Snapshot]:
    """This process's kept snapshot, up to date, held for a pass's planning and writing (KeptIndex.planning)."""
    return _kept.planning(now=now)


def scratch(*, now: dt.datetime) -> Snapshot:
    """A copy of the up-to-date snapshot, for planning that reserves without writing (a dry run)."""
    return _kept.scratch(now=now)


def _every_node_changed(**_: object) -> None:
    changes.mark_all()


def connect_signals() -> None:
    """Mark the feed whenever a hold or a power budget is saved or deleted, whoever writes it.

    Every node's record may change with them (a hold's label, a budget's
    claims), so the feed says "everything" and readers rebuild; they change
    at an operator's pace.
    """
    for model in (Hold, PowerBudget):
        post_save.connect(_every_node_changed, sender=model, dispatch_uid=f"kept-{model.__name__}-save")
        post_delete.connect(_every_node_changed, sender=model, dispatch_uid=f"kept-{model.__name__}-delete")


def warm(*, keep_every_s: float | None = None, stop: threading.Event | None = None) -> threading.Thread:
    """Build this process's kept index in a background thread, then keep it current; the thread is returned.

    Every `keep_every_s` seconds (default LLMGW_KEPT_REFRESH_S; 0: build
    only) the thread applies what the feed marked since, until `stop` is set
    (tests) or the process ends. A pass that comes meanwhile waits on the
    index's lock rather than doing the same work twice. A build or an update
    that fails is logged, and the next one (or the next pass) tries again.
    """
    every = refresh_interval_s() if keep_every_s is None else keep_every_s
    stop = stop or threading.Event()

    def keep() -> None:
        what = "built as the worker process started"
        try:
            while True:
                try:
                    _kept.current(now=timezone.now())
                except Exception:  # the next update (or pass) tries again, and reports what is wrong
                    log.exception("the placement index could not be %s", what)
                    # A connection the error broke is replaced at the next query.
                    connection.close()
                what = "brought up to date in the background"
                if every <= 0 or stop.wait(every):
                    return
        finally:
            # This thread's own connection: it is never used again.
            connection.close()

    thread = threading.Thread(target=keep, name="llmgw-kept", daemon=True)
    thread.start()
    return thread


def _warm_prefork_child(**_: object) -> None:
    warm()


def _warm_unforked_worker(sender: object = None, **_: object) -> None:
    # A prefork worker's main process runs no task: its children warm their own.
    if not isinstance(getattr(sender, "pool", None), PreforkPool):
        warm()


def connect_worker_warmup() -> None:
    """Have every Celery process that runs tasks build its kept index as it starts, and keep it current.

    Built on first use, the index was built by the first reconcile pass with
    work to place, which at 10,000 nodes is 5-10 s of the scale-up that asked
    for it, once in each worker process, as passes went to one and then the
    other; and kept current only by the passes a process ran, it was as old
    as that process's last pass. In a thread, because Celery gives a starting
    child a few seconds to report in, and the build can take longer.
    """
    celery_signals.worker_process_init.connect(_warm_prefork_child, dispatch_uid="kept-warm-prefork-child")
    celery_signals.worker_ready.connect(_warm_unforked_worker, dispatch_uid="kept-warm-worker")


def index() -> KeptIndex:
    """This process's kept index (for tests and the benchmark)."""
    return _kept


def reset() -> None:
    """Forget the kept index: the next use rebuilds (a test's fresh database)."""
    global _kept
    _kept = KeptIndex()
