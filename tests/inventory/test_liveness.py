"""The liveness sweep: ready -> unreachable -> lost, and what lost means for shards."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from inventory import lag, liveness
from inventory.models import ControlPlaneEvent, LivenessClock, Node, NodeEvent, NodeState
from inventory.nodes import change_state
from inventory.tasks import liveness_sweep
from placement.models import PlacementEvent, Shard
from tests.agents.conftest import make_shard
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def at(now, seconds):
    return now + dt.timedelta(seconds=seconds)


def state(node_id="node-a"):
    return Node.objects.values_list("state", "unreachable_since").get(id=node_id)


def sweeps(now, *times):
    """Sweep at each offset (seconds from `now`), as beat does, without gaps; the results merged.

    The first sweep ever judges nothing (nothing says the control plane was
    listening before), so a steady run starts at offset 0.
    """
    total = liveness.SweepResult()
    for t in times:
        r = liveness.sweep(now=at(now, t))
        total.unreachable += r.unreachable
        total.lost += r.lost
        total.flagged += r.flagged
        total.failed_shards += r.failed_shards
        total.deferred = r.deferred
        total.suspended = r.suspended
    return total


def steady(now, start, end, step=10):
    """Sweep every `step` seconds from `start` to `end` (both included)."""
    times = [*range(start, end, step), end]
    return sweeps(now, *times)


def test_ready_unreachable_lost(now, settings):
    settings.LLMGW_UNREACHABLE_AFTER = 30
    settings.LLMGW_LOST_AFTER = 300
    make_node("node-a", now=now)
    shard = make_shard("node-a", now=now, state="ready")
    assert steady(now, 0, 29).unreachable == []
    result = liveness.sweep(now=at(now, 31))
    assert result.unreachable == ["node-a"]
    assert state() == (NodeState.UNREACHABLE, at(now, 31))
    assert Shard.objects.get(id=shard.id).state == "ready"
    assert steady(now, 39, 299).lost == []
    result = liveness.sweep(now=at(now, 301))
    assert result.lost == ["node-a"] and result.failed_shards == [str(shard.id)]
    assert state()[0] == NodeState.LOST
    row = Shard.objects.get(id=shard.id)
    assert (row.state, row.reason) == ("failed", "node lost")
    assert PlacementEvent.objects.get().to_state == "failed"
    messages = list(
        NodeEvent.objects.filter(node_id="node-a", kind="state").order_by("at").values_list("message", flat=True)
    )
    assert messages == ["ready -> unreachable: no heartbeat for 30 s", "unreachable -> lost: no heartbeat for 300 s"]
    # Idempotent.
    again = steady(now, 310, 400)
    assert (again.unreachable, again.lost, again.failed_shards) == ([], [], [])
    assert ControlPlaneEvent.objects.count() == 0


def test_a_gap_between_sweeps_is_not_held_against_nodes(now):
    """The database (or beat) was down for an hour: that silence is the control plane's, not the node's."""
    make_node("node-a", now=now)
    shard = make_shard("node-a", now=now, state="ready")
    sweeps(now, 0, 10)
    result = liveness.sweep(now=at(now, 3600))
    assert (result.unreachable, result.lost) == ([], [])
    (event,) = ControlPlaneEvent.objects.all()
    assert event.kind == "blind" and event.message.startswith("no liveness sweep for 3590 s")
    clock = LivenessClock.objects.get()
    assert (clock.blind_from, clock.blind_until) == (at(now, 10), at(now, 3600))
    # Judged again on silence heard after the gap: 10 s before it, 21 after.
    assert steady(now, 3610, 3620).unreachable == []
    assert liveness.sweep(now=at(now, 3621)).unreachable == ["node-a"]
    assert steady(now, 3630, 3890).lost == []
    assert liveness.sweep(now=at(now, 3891)).lost == ["node-a"]
    assert Shard.objects.get(id=shard.id).state == "failed"


def test_a_heartbeat_within_the_grace_after_an_outage_keeps_the_shards(now, client):
    """The fleet returns a few seconds after the control plane: nothing is marked, nothing stopped."""
    for i in range(3):
        make_node(f"node-{i}", now=now)
        make_shard(f"node-{i}", now=now, state="ready")
    steady(now, 0, 20)
    # 30 s with no sweep and no heartbeat (the database was down), then the agents come back within 5 s.
    result = liveness.sweep(now=at(now, 51))
    assert (result.unreachable, result.lost) == ([], [])
    Node.objects.update(last_seen=at(now, 55))
    result = steady(now, 61, 400)
    assert (result.unreachable, result.lost) == ([], [])
    assert not Shard.objects.exclude(state="ready").exists()


def test_most_of_the_fleet_silent_at_once_is_the_control_planes_fault(now):
    """Kubernetes' full disruption: beyond 55 % silent at once, no node is judged; said in events."""
    for i in range(5):
        make_node(f"node-{i}", now=now)
        make_shard(f"node-{i}", now=now, state="ready")
    sweeps(now, 0)
    # Four of five go silent at once (the web tier died); node-4 still heartbeats.
    for t in range(10, 700, 10):
        Node.objects.filter(id="node-4").update(last_seen=at(now, t))
        result = liveness.sweep(now=at(now, t))
        assert result.lost == [], t
    assert result.suspended
    assert not Shard.objects.exclude(state="ready").exists()
    assert Node.objects.filter(state=NodeState.READY).count() == 5
    kinds = list(ControlPlaneEvent.objects.order_by("at").values_list("kind", "message"))
    assert kinds == [
        (
            "mass_silence",
            "4 of 5 nodes went silent at once: read as the control plane's own outage (web, cache, network); "
            "no node is marked unreachable or lost until heartbeats resume",
        )
    ]
    # Heartbeats resume (three of the four): the silence is over, and its span is not held against node-3.
    Node.objects.exclude(id="node-3").update(last_seen=at(now, 700))
    result = liveness.sweep(now=at(now, 700))
    assert not result.suspended and result.unreachable == []
    assert ControlPlaneEvent.objects.order_by("-at", "-id").first().kind == "mass_silence_over"
    Node.objects.exclude(id="node-3").update(last_seen=at(now, 725))
    assert steady(now, 710, 729).unreachable == []
    assert liveness.sweep(now=at(now, 730)).unreachable == ["node-3"]


def test_a_silence_trickling_in_over_sweeps_is_seen_before_any_verdict(now):
    """Heartbeats stop staggered; the whole fleet's silence is judged before the first node is due."""
    for i in range(3):
        make_node(f"node-{i}", now=at(now, i * 4))
    # Ages 10, 6 and 2 s: none has missed two heartbeats yet.
    assert not sweeps(now, 0, 10).suspended
    # Ages 20, 16 and 12 s: all three have, ten seconds before node-0's unreachable deadline.
    assert liveness.sweep(now=at(now, 20)).suspended
    result = liveness.sweep(now=at(now, 31))
    assert result.suspended and result.unreachable == []
    assert steady(now, 41, 600).lost == []


def test_lost_nodes_are_declared_at_a_bounded_rate(now, settings):
    settings.LLMGW_LOST_RATE = 0.1
    settings.LLMGW_MASS_SILENCE = 1.0  # this test is about the rate, not about mass silence
    for i in range(12):
        make_node(f"node-{i:02d}", now=at(now, -i))
    assert steady(now, 0, 291).lost == []
    # 12 nodes: at most two a sweep, the longest silent first; the rest wait for the next sweeps.
    result = liveness.sweep(now=at(now, 301))
    assert result.lost == ["node-11", "node-10"]
    assert result.deferred == [f"node-{i:02d}" for i in range(9, -1, -1)]
    assert [len(liveness.sweep(now=at(now, t)).lost) for t in range(311, 371, 10)] == [2, 2, 2, 2, 2, 0]
    assert Node.objects.filter(state=NodeState.LOST).count() == 12


def test_a_fresh_heartbeat_wins_over_the_sweep(now):
    make_node("node-a", now=now)
    # The sweep saw it silent, but it heartbeated before the lock was taken.
    Node.objects.filter(id="node-a").update(last_seen=at(now, 100))
    assert not liveness.mark_unreachable("node-a", now=at(now, 101), cutoff=at(now, 71))
    assert state()[0] == NodeState.READY


@pytest.mark.parametrize("operator_state", [NodeState.CORDONED, NodeState.DRAINING])
def test_cordoned_and_draining_keep_their_state_but_are_flagged(now, operator_state):
    make_node("node-a", now=now)
    change_state("node-a", operator_state, now=now)
    shard = make_shard("node-a", now=now, state="ready")
    steady(now, 0, 30)
    result = liveness.sweep(now=at(now, 31))
    assert result.flagged == ["node-a"] and result.unreachable == []
    assert state() == (operator_state, at(now, 31))
    assert steady(now, 41, 291).flagged == []
    # Silent past the lost delay: its shards are dead, its state is the operator's.
    result = liveness.sweep(now=at(now, 301))
    assert result.failed_shards == [str(shard.id)] and result.lost == ["node-a"]
    assert state()[0] == operator_state
    assert Shard.objects.get(id=shard.id).state == "failed"


def test_the_task_runs_the_sweep(now):
    make_node("node-a", now=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    # The first sweep ever judges nothing; one a moment ago says the control plane was listening.
    assert liveness_sweep() == {"unreachable": 0, "lost": 0, "flagged": 0, "failed_shards": 0}
    LivenessClock.objects.update(blind_from=None, blind_until=None)
    assert liveness_sweep() == {"unreachable": 1, "lost": 1, "flagged": 0, "failed_shards": 0}
    assert liveness_sweep() == {"unreachable": 0, "lost": 0, "flagged": 0, "failed_shards": 0}


def test_beat_schedules_the_sweep(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["agents.liveness_sweep"]
    assert entry == {"task": "agents.liveness_sweep", "schedule": 10.0}
    assert settings.LLMGW_SWEEP_GAP == 25.0


# The clock (a locked read, two counts, its write), how much of the fleet was heard (inventory/lag.py)
# and the sweep's reads, whatever the number of nodes.
QUERIES = 12


def test_silent_cordoned_nodes_cost_the_sweep_no_query_each(now, settings, django_assert_num_queries):
    def silent_cordoned(node_id: str) -> None:
        make_node(node_id, now=now)
        change_state(node_id, NodeState.CORDONED, now=now)
        make_shard(node_id, now=now, state="stopped")
        make_shard(node_id, now=now, state="failed")

    settings.LLMGW_MASS_SILENCE = 1.0
    silent_cordoned("node-a")
    steady(now, 0, 291)  # flags it
    with django_assert_num_queries(QUERIES):
        assert liveness.sweep(now=at(now, 301)).failed_shards == []
    for i in range(5):
        silent_cordoned(f"node-{i}")
    steady(now, 311, 591)
    # Shards that are over leave the node alone, and more such nodes cost nothing more.
    with django_assert_num_queries(QUERIES):
        assert liveness.sweep(now=at(now, 601)).failed_shards == []
    assert PlacementEvent.objects.count() == 0


def _fleet(now, count: int) -> list[str]:
    ids = [f"node-{i:03d}" for i in range(count)]
    for node_id in ids:
        make_node(node_id, now=now)
    return ids


def heartbeats_behind(now, t: int, ids: list[str], spread: int) -> None:
    """Each node last heard 0 to spread-1 seconds before t: a web tier answering heartbeats late, all alike."""
    for i, node_id in enumerate(ids):
        Node.objects.filter(id=node_id).update(last_seen=at(now, t - i % spread))


def test_a_control_plane_hearing_part_of_its_fleet_waits_longer_before_it_judges(now, settings):
    """A backlog delays every heartbeat: late nodes are not silent ones, and no replica is failed for it."""
    settings.LLMGW_HEARTBEAT_INTERVAL = 5
    settings.LLMGW_UNREACHABLE_AFTER = 10
    settings.LLMGW_LOST_AFTER = 20
    ids = _fleet(now, 120)
    make_shard("node-017", now=now, state="ready")
    sweeps(now, 0)
    # Heard every 18 s on average where the interval is 5 (the web tier answers a fraction of the fleet):
    # 7 of each 18 nodes within the last 6.25 s.
    for t in range(10, 200, 10):
        heartbeats_behind(now, t, ids, 18)
        result = liveness.sweep(now=at(now, t))
        assert (result.unreachable, result.lost, result.suspended) == ([], [], False), t
    assert result.stretch == lag.MAX_STRETCH  # 1.25 x 120 / 49 = 3.06, bounded
    assert lag.hearing(now=at(now, 190)) == lag.Hearing(nodes=120, heard=49, stretch=3.0)
    assert Node.objects.filter(state=NodeState.READY).count() == 120
    assert not Shard.objects.exclude(state="ready").exists()
    # A node that really stopped is still judged, after the stretched delays (30 s, then 60 s).
    for t in range(200, 300, 10):
        heartbeats_behind(now, t, ids[1:], 18)
        result = liveness.sweep(now=at(now, t))
        if result.unreachable:
            assert (t, result.unreachable) == (230, ["node-000"])  # last heard at 190
    assert state("node-000")[0] == NodeState.LOST


def test_the_same_late_heartbeats_without_the_stretch_would_mark_live_nodes(now, settings, monkeypatch):
    """What the stretch prevents: read at face value, the late nodes cross the 10 s delay."""
    settings.LLMGW_HEARTBEAT_INTERVAL = 5
    settings.LLMGW_UNREACHABLE_AFTER = 10
    settings.LLMGW_LOST_AFTER = 20
    ids = _fleet(now, 120)
    sweeps(now, 0)
    heartbeats_behind(now, 10, ids, 18)
    monkeypatch.setattr(lag, "MAX_STRETCH", 1.0)
    monkeypatch.setattr(lag, "LATE_MIN", 10**6)  # nor the intake's lag (below)
    marked = liveness.sweep(now=at(now, 10)).unreachable
    # Ages 11 to 17 s: 7 of each 18 nodes (node-011 ... node-017, node-029 ... , node-119), none of them silent.
    assert len(marked) == 7 * 6 + 1
    assert "node-011" in marked and "node-010" not in marked


def heard_at(now, t: int, ages: dict[str, float]) -> None:
    """Each node last heard `ages[node]` seconds before t."""
    for node_id, age in ages.items():
        Node.objects.filter(id=node_id).update(last_seen=now + dt.timedelta(seconds=t - age))


def backlog(ids: list[str]) -> dict[str, float]:
    """A web tier behind by a few seconds while 100 of 120 nodes (83 %, over the share that stretches) are heard
    within 1.25 intervals: 15 nodes 7 to 9 s late, waiting their turn, and 5 past the 10 s delay (11 and 12 s)."""
    ages = {node_id: float(i % 5) for i, node_id in enumerate(ids[:100])}
    ages |= {node_id: 7.0 + i % 3 for i, node_id in enumerate(ids[100:115])}
    ages |= {node_id: 11.0 + i % 2 for i, node_id in enumerate(ids[115:])}
    return ages


@pytest.fixture
def short_delays(settings):
    settings.LLMGW_HEARTBEAT_INTERVAL = 5
    settings.LLMGW_UNREACHABLE_AFTER = 10
    settings.LLMGW_LOST_AFTER = 20


def test_a_late_tail_while_most_of_the_fleet_is_heard_marks_no_live_node(now, short_delays):
    """The tail the share misses: 83 % heard, yet 5 live nodes past the delay behind a backlog."""
    ids = _fleet(now, 120)
    sweeps(now, 0)
    heard_at(now, 10, backlog(ids))
    assert lag.hearing(now=at(now, 10)) == lag.Hearing(nodes=120, heard=100, stretch=1.0)
    # The third oldest node not yet due is 9 s old: 2.75 s past an on-time 6.25 s.
    assert lag.intake_lag(now=at(now, 10), nodes=120) == 2.75
    result = liveness.sweep(now=at(now, 10))
    assert (result.unreachable, result.lost, result.lag_s, result.stretch) == ([], [], 2.75, 1.0)
    assert Node.objects.filter(state=NodeState.READY).count() == 120


def test_the_same_tail_without_the_intakes_lag_would_mark_five_live_nodes(now, short_delays, monkeypatch):
    ids = _fleet(now, 120)
    sweeps(now, 0)
    heard_at(now, 10, backlog(ids))
    monkeypatch.setattr(lag, "LATE_MIN", 10**6)
    assert sorted(liveness.sweep(now=at(now, 10)).unreachable) == ids[115:]


def test_nodes_that_die_together_are_judged_on_time_beside_a_backlog(now, short_delays):
    """Past the delay they leave the tail the lag is read from: the same sweep judges them."""
    ids = _fleet(now, 120)
    sweeps(now, 0)
    ages = {node_id: float(i % 5) for i, node_id in enumerate(ids[:110])}
    ages |= {node_id: 10.5 for node_id in ids[110:]}  # a rack's ten trays, silent since the same moment
    heard_at(now, 10, ages)
    result = liveness.sweep(now=at(now, 10))
    assert (sorted(result.unreachable), result.lag_s) == (ids[110:], 0.0)


def test_nodes_dying_one_after_another_wait_while_three_are_late(now, short_delays):
    """The trade-off: three or more nodes dying within the delay read as lag; the first waits for the third."""
    ids = _fleet(now, 120)
    sweeps(now, 0)
    healthy = {node_id: float(i % 5) for i, node_id in enumerate(ids[:116])}
    dead = dict(zip(ids[116:], [10.5, 9.0, 8.0, 7.0], strict=True))  # last heard 0.5, 2, 3 and 4 s before 10 s
    marked = {}
    for t in (10, 11, 12, 13, 13.5):
        heard_at(now, t, healthy | {n: age + t - 10 for n, age in dead.items()})
        result = liveness.sweep(now=at(now, t))
        marked[t] = (sorted(result.unreachable), result.lag_s)
    assert (
        marked
        == {
            10: ([], 0.75),  # the three others 7 to 9 s old: the first (10.5 s) waits
            11: ([], 1.75),
            12: (ids[116:118], 0.0),  # the third is at the delay: two late ones left, no lag; 2 s late for the first
            13: ([ids[118]], 0.0),
            13.5: ([ids[119]], 0.0),  # the last on time
        }
    )


def test_a_fleet_heard_in_full_or_too_small_to_read_judges_on_time(now, settings):
    settings.LLMGW_HEARTBEAT_INTERVAL = 5
    ids = _fleet(now, 120)
    for node_id in ids[:100]:
        Node.objects.filter(id=node_id).update(last_seen=at(now, 100))
    # 100 of 120 heard: the web tier keeps up; the 20 others are simply silent.
    assert lag.hearing(now=at(now, 104)) == lag.Hearing(nodes=120, heard=100, stretch=1.0)
    Node.objects.filter(id__in=ids[100:]).delete()
    Node.objects.update(last_seen=now)
    # 100 nodes, none heard: too small a share, but past MIN_NODES, so the bound applies.
    assert lag.hearing(now=at(now, 104)) == lag.Hearing(nodes=100, heard=0, stretch=3.0)
    Node.objects.filter(id__in=ids[:1]).delete()
    # 99 nodes: too few to read.
    assert lag.hearing(now=at(now, 104)) == lag.Hearing(nodes=99, heard=0, stretch=1.0)


def test_the_task_judges_and_does_not_fail_with_the_cache_gone(redis_gone):
    """The schedule's slot is in the cache: without it the sweep still judges, and the tick is the schedule."""
    make_node("node-a", now=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    make_node("node-b", now=timezone.now())
    make_node("node-c", now=timezone.now())
    assert liveness_sweep(due="2000-01-01T00:00:00+00:00")["unreachable"] == 0  # the first sweep ever judges nothing
    LivenessClock.objects.update(blind_from=None, blind_until=None)
    assert liveness_sweep() == {"unreachable": 1, "lost": 1, "flagged": 0, "failed_shards": 0}
    assert state()[0] == NodeState.LOST
