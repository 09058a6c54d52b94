"""A fleet is never blamed for its control plane: an outage of the web tier marks no live node.

A hundred nodes heartbeat every 5 s (jittered as agents jitter), sweeps run on
beat's tick and at each node's own deadline (inventory/sweep_schedule.py), and
the web tier stops hearing heartbeats for a while. Agents retry with their own
backoff (capped at a few seconds), so the fleet comes back staggered. Time is
passed in: the whole run is a few hundred sweeps on the real database.
"""

from __future__ import annotations

import bisect
import datetime as dt
import heapq
import random

import pytest
from django.conf import settings
from django.db import connection

from inventory import liveness, sweep_schedule
from inventory.models import ControlPlaneEvent, Node, NodeEvent, NodeState
from llmgw_agent.loop import backoff_delay
from placement.models import Shard
from tests.agents.conftest import make_shard
from tests.factories import make_node

pytestmark = pytest.mark.django_db

INTERVAL = 5.0
TICK = 10.0


def heartbeat_times(
    rng: random.Random, *, end: float, outage: tuple[float, float], dies_at: float | None
) -> list[float]:
    """When one agent's heartbeats reach the control plane: every interval ±10 %, retried with backoff in an outage."""
    times, t, failures = [], rng.uniform(0, INTERVAL), 0
    while t < end and (dies_at is None or t < dies_at):
        if outage[0] <= t < outage[1]:
            failures += 1
            t += backoff_delay(failures, rng)
            continue
        times.append(t)
        failures = 0
        t += INTERVAL * rng.uniform(0.9, 1.1)
    return times


class Fleet:
    """Nodes (a hundred unless told) with their heartbeats laid out in advance, swept as beat and the schedule would."""

    def __init__(
        self, now: dt.datetime, *, nodes: int = 100, outage: tuple[float, float], dead: dict[str, float], end: float
    ) -> None:
        rng = random.Random(28)
        self.now = now
        self.ids = [f"node-{i:03d}" for i in range(nodes)]
        for node_id in self.ids:
            make_node(node_id, now=now, gpus=1)
        for node_id in self.ids[::20]:
            make_shard(node_id, now=now, state="ready")
        self.beats = {
            node_id: heartbeat_times(rng, end=end, outage=outage, dies_at=dead.get(node_id)) for node_id in self.ids
        }
        self.end = end
        self.verdicts: list[tuple[float, str, str]] = []
        self.suspended = 0

    def at(self, t: float) -> dt.datetime:
        return self.now + dt.timedelta(seconds=t)

    def heard(self, t: float) -> None:
        """Every node's last_seen as the leases renewed it up to t."""
        ids, seen = [], []
        for node_id, beats in self.beats.items():
            i = bisect.bisect_right(beats, t)
            ids.append(node_id)
            seen.append(self.at(beats[i - 1] if i else -INTERVAL))
        # One statement for the fleet (bulk_update's CASE over a hundred rows costs seconds a run).
        with connection.cursor() as cur:
            cur.execute(
                f"UPDATE {Node._meta.db_table} AS n SET last_seen = v.t "
                "FROM unnest(%s::text[], %s::timestamptz[]) AS v(id, t) WHERE n.id = v.id",
                [ids, seen],
            )

    def run(self) -> None:
        """Beat's tick every 10 s, and a sweep at the next node deadline within the tick, as schedule_next queues."""
        queue = [t + 3.0 for t in range(0, int(self.end), int(TICK))]
        heapq.heapify(queue)
        pending: dt.datetime | None = None
        while queue:
            t = heapq.heappop(queue)
            if pending is not None and self.at(t) >= pending:
                pending = None
            self.heard(t)
            result = liveness.sweep(now=self.at(t))
            self.suspended += result.suspended
            self.verdicts += [(t, "unreachable", n) for n in result.unreachable]
            self.verdicts += [(t, "lost", n) for n in result.lost]
            ready, unreachable = sweep_schedule.oldest_deadlines(self.at(t))
            due = sweep_schedule.next_due(
                self.at(t),
                ready_last_seen=[ready],
                unreachable_last_seen=[unreachable],
                unreachable_after=settings.LLMGW_UNREACHABLE_AFTER,
                lost_after=settings.LLMGW_LOST_AFTER,
            )
            if sweep_schedule.should_schedule(due, pending, now=self.at(t), horizon_s=TICK):
                pending = due
                heapq.heappush(queue, (due - self.now).total_seconds())


@pytest.mark.parametrize(("nodes", "seconds"), [(100, 45), (100, 360), (40, 45)])
def test_a_web_tier_outage_of_any_length_marks_no_live_node(now, nodes, seconds):
    """Killed for 45 s (every node crosses the unreachable delay) or 6 minutes (past the lost delay).

    40 nodes are too few for the lag stretch (inventory/lag.py) to hide the
    silence: the mass-silence judgement alone must see it.
    """
    start = 40.0
    fleet = Fleet(now, nodes=nodes, outage=(start, start + seconds), dead={}, end=start + seconds + 60)
    fleet.run()
    assert fleet.verdicts == []
    assert fleet.suspended > 0
    assert Node.objects.filter(state=NodeState.READY).count() == nodes
    assert not NodeEvent.objects.filter(kind="state").exists()
    assert not Shard.objects.exclude(state="ready").exists()
    kinds = list(ControlPlaneEvent.objects.order_by("at", "id").values_list("kind", flat=True))
    assert kinds == ["mass_silence", "mass_silence_over"]


def test_a_few_nodes_really_silent_are_judged_on_time(now):
    """Three nodes die: each is unreachable at its own deadline and lost at the lost delay, to the sweep."""
    dead = {"node-000": 20.0, "node-041": 21.0, "node-077": 23.0}
    fleet = Fleet(now, outage=(0.0, 0.0), dead=dead, end=340.0)
    last = {n: fleet.beats[n][-1] for n in dead}
    fleet.run()
    ua, la, slack = settings.LLMGW_UNREACHABLE_AFTER, settings.LLMGW_LOST_AFTER, sweep_schedule.SLACK_S
    # Each verdict at the first sweep past its delay: never later than the scheduled one (the slack after it).
    assert sorted((n, kind) for _, kind, n in fleet.verdicts) == sorted(
        [(n, "unreachable") for n in dead] + [(n, "lost") for n in dead]
    )
    for t, kind, n in fleet.verdicts:
        silent = t - last[n]
        delay = ua if kind == "unreachable" else la
        assert delay < silent <= delay + slack + 1e-6, (n, kind, silent)
    assert fleet.suspended == 0
    assert Node.objects.filter(state=NodeState.LOST).count() == 3
    assert Node.objects.filter(state=NodeState.READY).count() == 97
    assert ControlPlaneEvent.objects.count() == 0
