"""The kept placement index: reloads what the change feed names, rebuilds on a gap, equals a fresh build."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from celery import signals as celery_signals
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from django.core.cache import cache

import llmgw_wire as wire
from inventory import changes, telemetry
from inventory.allocation import allocate, release_replica
from inventory.heartbeat import apply_engine_installs
from inventory.models import Node
from inventory.nodes import change_state, set_operator_labels
from inventory.operations import forget
from placement import kept, snapshot_db
from placement.models import Deployment, EngineProfile, Hold, PowerBudget, Shard
from placement.planner import ReplicaRequest, plan
from placement.reconciler import reconcile
from placement.signals import replicas_changed
from placement.snapshot import Snapshot
from tests.factories import make_node

pytestmark = pytest.mark.django_db

SM_A = "0x0002c90300000001"
SM_B = "0x0002c90300000002"
# One query per table of a node's reload, and the lease's one query.
RELOAD_QUERIES = 9
# A node whose holdings alone changed: its allocated GPUs, its allocations' sums, its shards' ports.
HOLDINGS_QUERIES = 3
LEASE_QUERIES = 1


def ib_port(hca: str, sm: str, sms=()) -> dict:
    return {"hca": hca, "port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand", "sm_guid": sm, "sms": list(sms)}


def put_telemetry(node_id: str, entry: dict) -> None:
    # As the heartbeat does it: the entry, then the feed when placement's view of it changed.
    previous = telemetry.get(node_id)
    telemetry.put(node_id, entry)
    changes.mark_telemetry(node_id, previous, entry)


def fabric_node(node_id: str, now: dt.datetime, **kw):
    return make_node(node_id, now=now, fabrics=[{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400}], **kw)


def normalized(snap: Snapshot) -> dict:
    """Everything a snapshot holds, with the index's emptied buckets left out (they mean nothing)."""
    index = {}
    for slot, buckets in snap._index.items():
        kept_buckets = {c: list(ids) for c, ids in buckets.items() if ids}
        if kept_buckets:
            index[slot] = kept_buckets
    return {
        "nodes": dict(snap.nodes),
        "budgets": snap.budgets,
        "budget_used": {k: round(v, 6) for k, v in snap.budget_used.items() if v},
        "port_base": snap.port_base,
        "cluster_ports": snap.cluster_ports,
        "host_ports": {k: v for k, v in snap.host_ports.items()},
        "index": index,
    }


@pytest.fixture
def loads(monkeypatch):
    """The node ids each call of the per-node loader read (None: every node)."""
    calls: list[list[str] | None] = []
    real = snapshot_db.load

    def spy(node_ids=None):
        calls.append(None if node_ids is None else sorted(node_ids))
        return real(node_ids)

    monkeypatch.setattr(snapshot_db, "load", spy)
    return calls


@pytest.fixture(autouse=True)
def _fresh_index():
    kept.reset()
    yield
    kept.reset()


def test_first_use_builds_then_nothing_changed_reads_nothing(now, loads, django_assert_num_queries):
    for i in range(3):
        fabric_node(f"n{i}", now)
    first = kept.current(now=now)
    assert loads == [None] and kept.index().rebuilds == 1
    with django_assert_num_queries(LEASE_QUERIES):
        again = kept.current(now=now)
    assert again is first
    assert loads == [None] and kept.index().rebuilds == 1 and kept.index().reloaded == 0


def test_a_change_to_one_node_reloads_exactly_that_node(now, loads, django_assert_num_queries):
    for i in range(4):
        make_node(f"n{i}", now=now)
    kept.current(now=now)
    change_state("n2", "cordoned", now=now)
    with django_assert_num_queries(RELOAD_QUERIES + LEASE_QUERIES):
        snap = kept.current(now=now)
    assert loads == [None, ["n2"]]
    assert kept.index().rebuilds == 1 and kept.index().reloaded == 1
    assert snap.nodes["n2"].state == "cordoned"
    assert not any("n2" in ids for b in snap._index.values() for ids in b.values())


def test_another_writers_claim_and_release_reload_the_nodes_holdings_alone(now, loads, django_assert_num_queries):
    for i in range(3):
        fabric_node(f"n{i}", now)
    kept.current(now=now)
    replica = uuid.uuid4()
    allocate(node_id="n1", replica_id=replica, shard_id=uuid.uuid4(), gpu_indices=[0, 3], memory_gb=12, power_w=800.0)
    with django_assert_num_queries(HOLDINGS_QUERIES + LEASE_QUERIES):
        snap = kept.current(now=now)
    claimed = normalized(snap)
    assert loads == [None]
    assert (kept.index().reloaded, kept.index().reloaded_holdings) == (0, 1)
    n1 = snap.nodes["n1"]
    assert (sorted(set(range(8)) - n1.free), n1.memory_claimed_gb) == ([0, 3], 12)
    assert claimed == normalized(snapshot_db.build(now=now))
    release_replica(replica)
    snap = kept.current(now=now)
    assert kept.index().rebuilds == 1 and kept.index().reloaded_holdings == 2
    assert snap.nodes["n1"].free == frozenset(range(8)) and snap.nodes["n1"].memory_claimed_gb == 0
    assert normalized(snap) == normalized(snapshot_db.build(now=now))
    # Holdings and another change of one node in the same read: it is read whole, once.
    allocate(node_id="n2", replica_id=replica, shard_id=uuid.uuid4(), gpu_indices=[1], memory_gb=1)
    change_state("n2", "cordoned", now=now)
    del loads[:]
    snap = kept.current(now=now)
    assert loads == [["n2"]] and kept.index().reloaded_holdings == 2
    assert normalized(snap) == normalized(snapshot_db.build(now=now))


def test_a_gap_in_the_feed_rebuilds(now, loads):
    make_node("a", now=now)
    kept.current(now=now)
    version = kept.index().version
    change_state("a", "cordoned", now=now)
    # The entry expired (or was never written): the reader cannot know what it said.
    cache.delete(changes._entry_key(version + 1))
    snap = kept.current(now=now)
    assert loads == [None, None] and kept.index().rebuilds == 2
    assert snap.nodes["a"].state == "cordoned"


def test_a_flushed_feed_rebuilds(now, loads):
    make_node("a", now=now)
    kept.current(now=now)
    cache.clear()
    make_node("b", now=now)
    snap = kept.current(now=now)
    assert loads == [None, None] and set(snap.nodes) == {"a", "b"}


def test_holds_and_budgets_rebuild(now, loads):
    make_node("a", now=now, labels={"rack": "r1"})
    kept.current(now=now)
    Hold.objects.create(scope="label", label_key="rack", label_value="r1")
    assert kept.current(now=now).nodes["a"].held == "held: rack=r1"
    PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=1000)
    assert kept.current(now=now).budgets == {("rack", "r1"): 1000}
    assert loads == [None, None, None]


def test_the_lease_is_read_without_the_feed(now, loads, settings):
    make_node("a", now=now)
    make_node("b", now=now)
    kept.current(now=now)
    later = now + dt.timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER + 5)
    Node.objects.filter(id="b").update(last_seen=later)
    snap = kept.current(now=later)
    assert (snap.nodes["a"].silent_s, snap.nodes["b"].silent_s) == (int(settings.LLMGW_UNREACHABLE_AFTER) + 5, 0)
    Node.objects.filter(id="a").update(last_seen=later)
    assert kept.current(now=later).nodes["a"].silent_s == 0
    assert loads == [None]


def test_kept_equals_a_fresh_build_after_a_series_of_changes(now, settings):
    settings.LLMGW_SHARD_PORTS_UNIQUE = True
    fabric_node("a", now, labels={"rack": "r1"})
    fabric_node("b", now, labels={"rack": "r1"}, mgmt_addr="10.0.0.2")
    make_node("c", now=now, labels={"rack": "r2"})
    put_telemetry("a", {"ib_ports": [ib_port("mlx5_0", SM_A), ib_port("mlx5_1", SM_A)]})
    put_telemetry("b", {"ib_ports": [ib_port("mlx5_0", SM_B), ib_port("mlx5_1", SM_B)]})
    PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=40_000)
    t = now

    def check() -> Snapshot:
        snap = kept.current(now=t)
        assert normalized(snap) == normalized(snapshot_db.build(now=t))
        return snap

    check()
    # A subnet manager listed beside another: two fabrics become one, and b's key changes without b changing.
    put_telemetry(
        "a", {"ib_ports": [ib_port("mlx5_0", SM_A, [{"guid": SM_A}, {"guid": SM_B}]), ib_port("mlx5_1", SM_A)]}
    )
    snap = check()
    assert snap.nodes["b"].fabrics[0].key == f"sm:{SM_A}"
    # A port down, a power limit reported.
    put_telemetry("b", {"ib_ports": [ib_port("mlx5_0", SM_B)], "gpus": [{"index": 0, "power_limit_w": 500.0}]})
    check()
    # Claims written by another process.
    replica = uuid.uuid4()
    allocate(node_id="a", replica_id=replica, shard_id=uuid.uuid4(), gpu_indices=[0, 1], memory_gb=10, power_w=900.0)
    check()
    # A reconcile pass's own placement: written, reserved in the kept snapshot, not reloaded.
    prof = EngineProfile.objects.create(name="p", engine="echo", gpus_per_node=2)
    Deployment.objects.create(name="d", served_model="m", profile=prof, replicas=1)
    assert reconcile(now=t).placed == 1
    check()
    release_replica(replica)
    check()
    # Labels, states, engine installs, a new node, a forgotten one.
    set_operator_labels("c", {"rack": "r1"}, now=t)
    check()
    change_state("b", "cordoned", now=t)
    check()
    apply_engine_installs("c", [wire.EngineInstall(engine="vllm", state="failed", detail="no wheel")])
    check()
    make_node("d", now=t, mgmt_addr="10.0.0.2")
    check()
    forget("d", now=t)
    check()
    # Time passes: the lease runs out for some.
    t = now + dt.timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER + 1)
    Node.objects.filter(id__in=["a", "c"]).update(last_seen=t)
    check()
    # A hold.
    Hold.objects.create(scope="fabric", fabric="ib0")
    check()


def test_a_dry_run_copy_leaves_the_kept_index_alone(now):
    for i in range(3):
        make_node(f"n{i}", now=now)
    before = normalized(kept.current(now=now))
    scratch = kept.scratch(now=now)
    for _ in range(3):
        result = plan(ReplicaRequest(gpus_per_node=8), scratch)
        assert result.ok
        scratch.reserve(result)
    assert not any(n.free for n in scratch.nodes.values())
    assert normalized(kept.current(now=now)) == before


def test_settings_it_was_built_under_changing_rebuild(now, loads, settings):
    make_node("a", now=now)
    kept.current(now=now)
    settings.LLMGW_SHARD_PORTS_UNIQUE = not settings.LLMGW_SHARD_PORTS_UNIQUE
    kept.current(now=now)
    assert loads == [None, None]


def test_the_safety_net_rebuilds_after_its_interval(now, loads, settings):
    make_node("a", now=now)
    settings.LLMGW_KEPT_REBUILD_S = 0.0
    kept.current(now=now)
    kept.current(now=now)
    assert loads == [None, None]


def test_a_pass_does_not_reload_what_it_placed_but_does_reload_others_changes(now, loads):
    for i in range(3):
        make_node(f"n{i}", now=now)
    prof = EngineProfile.objects.create(name="p", engine="echo", gpus_per_node=2)
    dep = Deployment.objects.create(name="d", served_model="m", profile=prof, replicas=1)
    assert reconcile(now=now).placed == 1
    Deployment.objects.filter(id=dep.id).update(replicas=2)
    assert reconcile(now=now).placed == 1
    # The second pass read the feed and found only the first pass's own marks.
    assert loads == [None]
    placed_on = {s.node_id for s in Shard.objects.all()}
    assert len(placed_on) == 1
    node = placed_on.pop()
    # Another writer's change to that same node is reloaded.
    change_state(node, "cordoned", now=now)
    snap = kept.current(now=now)
    assert loads == [None, [node]] and snap.nodes[node].state == "cordoned"
    assert normalized(snap) == normalized(snapshot_db.build(now=now))


def test_an_update_of_the_kept_index_leaves_a_dry_run_copy_alone(now):
    # A dry run in one web thread plans on its copy while another thread's request updates the index.
    for i in range(3):
        make_node(f"n{i}", now=now)
    scratch = kept.scratch(now=now)
    before = normalized(scratch)
    change_state("n1", "cordoned", now=now)
    allocate(node_id="n2", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0, 1])
    updated = kept.current(now=now)
    assert normalized(scratch) == before
    assert normalized(updated) == normalized(snapshot_db.build(now=now))


@pytest.fixture
def warmups(monkeypatch):
    """The warm-up threads the Celery signals start, joined before the test reads the index."""
    threads: list = []
    stop = threading.Event()
    real = kept.warm

    def spy():
        threads.append(real(stop=stop))
        return threads[-1]

    monkeypatch.setattr(kept, "warm", spy)

    def joined() -> int:
        # Built first whatever the stop says; then the keeping ends.
        stop.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
        return len(threads)

    return joined


@pytest.mark.django_db(transaction=True)
def test_a_starting_prefork_child_builds_its_index_before_any_pass(now, loads, warmups):
    for i in range(3):
        make_node(f"n{i}", now=now)
    # What a prefork child sends as it starts (celery.concurrency.prefork.process_initializer).
    celery_signals.worker_process_init.send(sender="worker@host")
    assert warmups() == 1
    assert loads == [None] and kept.index().rebuilds == 1
    assert sorted(kept.index().snap.nodes) == ["n0", "n1", "n2"]
    # The first pass finds it built: nothing read again, nothing rebuilt.
    kept.current(now=now)
    assert loads == [None] and kept.index().rebuilds == 1


class _Consumer:
    """What worker_ready is sent with: the consumer, whose pool says whether tasks run in this process."""

    def __init__(self, pool_cls: type) -> None:
        self.pool = pool_cls.__new__(pool_cls)


@pytest.mark.django_db(transaction=True)
def test_a_solo_worker_warms_as_it_is_ready_and_a_prefork_parent_does_not(now, loads, warmups):
    make_node("n0", now=now)
    celery_signals.worker_ready.send(sender=_Consumer(PreforkPool))
    assert warmups() == 0 and loads == [] and kept.index().snap is None
    celery_signals.worker_ready.send(sender=_Consumer(SoloPool))
    assert warmups() == 1
    assert loads == [None] and sorted(kept.index().snap.nodes) == ["n0"]


@pytest.mark.django_db(transaction=True)
def test_a_warm_up_that_fails_leaves_the_build_to_the_first_pass(now, monkeypatch, caplog):
    make_node("n0", now=now)

    def broken(node_ids=None):
        raise RuntimeError("database went away")

    monkeypatch.setattr(snapshot_db, "load", broken)
    kept.warm(keep_every_s=0).join(timeout=30)
    assert kept.index().snap is None and kept.index().rebuilds == 0
    assert "the placement index could not be built as the worker process started" in caplog.text
    monkeypatch.undo()
    assert sorted(kept.current(now=now).nodes) == ["n0"]


def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_a_worker_process_keeps_its_index_current_between_the_passes_it_runs(now):
    for i in range(3):
        make_node(f"n{i}", now=now)
    stop = threading.Event()
    thread = kept.warm(keep_every_s=0.05, stop=stop)
    try:
        _until(lambda: kept.index().snap is not None)
        change_state("n1", "cordoned", now=now)
        # No pass ran here: the thread applied the feed by itself, reloading the one node.
        _until(lambda: kept.index().snap.nodes["n1"].state == "cordoned")
        assert kept.index().rebuilds == 1 and kept.index().reloaded == 1
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_feed_naming_most_of_the_nodes_is_a_rebuild_not_a_reload(now, loads, monkeypatch):
    monkeypatch.setattr(kept, "REBUILD_PAST", 2)
    for i in range(6):
        make_node(f"n{i}", now=now)
    kept.current(now=now)
    for i in range(3):
        change_state(f"n{i}", "cordoned", now=now)
    # Three of six: half, reloaded.
    kept.current(now=now)
    assert loads == [None, ["n0", "n1", "n2"]] and kept.index().rebuilds == 1
    for i in range(4):
        change_state(f"n{i}", "draining", now=now)
    # Four of six: more than half and than REBUILD_PAST, so read whole.
    snap = kept.current(now=now)
    assert loads == [None, ["n0", "n1", "n2"], None] and kept.index().rebuilds == 2
    assert [snap.nodes[f"n{i}"].state for i in range(6)] == ["draining"] * 4 + ["ready"] * 2


def test_a_reload_between_a_plan_and_its_write_forgets_the_plans_claim(now):
    # Why a pass holds the index while it plans (kept.planning): the batch writer reserves each plan in
    # the snapshot before its batch is written, and a reload reads the node as the database has it.
    make_node("n0", now=now)
    snap = kept.current(now=now)
    first = plan(ReplicaRequest(gpus_per_node=1), snap)
    snap.reserve(first)
    assert plan(ReplicaRequest(gpus_per_node=1), snap).shards[0].http_port == first.shards[0].http_port + 1
    # Another process changes the node before the batch is written, and the index is brought up to date.
    set_operator_labels("n0", {"rack": "r1"}, now=now)
    again = plan(ReplicaRequest(gpus_per_node=1), kept.current(now=now))
    # The first plan's port again, and its card: the database refuses the batch holding both.
    assert (again.shards[0].http_port, again.shards[0].gpu_indices) == (
        first.shards[0].http_port,
        first.shards[0].gpu_indices,
    )


@pytest.mark.django_db(transaction=True)
def test_a_pass_holds_the_index_from_its_first_plan_to_its_last_write(now):
    for i in range(2):
        make_node(f"n{i}", now=now)
    prof = EngineProfile.objects.create(name="p", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="d", served_model="m", profile=prof, replicas=4)
    taken: list[bool] = []

    def try_lock() -> None:
        # Another thread of the process, as the keeper (kept.warm) is.
        got = kept.index().lock.acquire(blocking=False)
        if got:
            kept.index().lock.release()
        taken.append(got)

    def other_thread(**_: object) -> None:
        t = threading.Thread(target=try_lock)
        t.start()
        t.join()

    # Sent as each batch's write commits, inside the pass.
    replicas_changed.connect(other_thread, dispatch_uid="test-kept-held")
    try:
        assert reconcile(now=now).placed == 4
    finally:
        replicas_changed.disconnect(dispatch_uid="test-kept-held")
    assert taken == [False]
    other_thread()
    assert taken == [False, True]
