"""The control plane's own lag: a web tier hearing fewer heartbeats than the fleet sends.

A control plane with too little CPU for its fleet answers heartbeats late and
queues the rest, so every node's last_seen falls behind alike. The liveness
sweep reads last_seen, and would take that delay for the nodes' silence: at
10,000 nodes on two cores, with heartbeats waiting up to 17 s, a run gave
8,295 unreachable and about 300 lost verdicts to live nodes, failed their
replicas and moved them, which is more work for the same cores. The mass-
silence check does not see it: no node is silent, each is late.

What the sweep can measure is how many of its nodes it heard from within
about one interval. A fleet heard in full says the web tier keeps up; a
fleet of which only a share was heard says each node is heard every
interval / share seconds on average, so silence must last that many times
longer before it counts. Too small a fleet says nothing (a handful of nodes
is noise), and the stretch is bounded, so a control plane that hears almost
no one still judges, later (most of the fleet silent at once is the mass-
silence check's case). The cost: while the control plane lags, a node that
really died is judged up to MAX_STRETCH times later.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count, Q

from inventory.models import Node, NodeState

# Below this many nodes heard-or-not, the share is too noisy to read.
MIN_NODES = 100
# The window is a little over one interval: agents jitter theirs by up to 10 %.
WINDOW_INTERVALS = 1.25
# Heard from at least this share within the window: the web tier keeps up.
HEALTHY_SHARE = 0.8
# However late the control plane, silence counts after at most this many times the configured delays.
MAX_STRETCH = 3.0


@dataclass(frozen=True)
class Hearing:
    """How much of the fleet the control plane heard from in the last window, and what that does to the delays."""

    nodes: int
    heard: int
    stretch: float


def hearing(*, now: dt.datetime) -> Hearing:
    """The share of nodes (not lost, not already silent) heard from in the last window, and the stretch it asks for.

    One query. stretch is 1.0 when the fleet is small or heard in full;
    otherwise the mean interval at which nodes are heard, over the configured
    interval, at most MAX_STRETCH.
    """
    window = WINDOW_INTERVALS * settings.LLMGW_HEARTBEAT_INTERVAL
    since = now - dt.timedelta(seconds=window)
    counts = (
        Node.objects.exclude(state=NodeState.LOST)
        .filter(unreachable_since__isnull=True)
        .aggregate(nodes=Count("id"), heard=Count("id", filter=Q(last_seen__gte=since)))
    )
    nodes, heard = counts["nodes"], counts["heard"]
    if nodes < MIN_NODES or heard >= HEALTHY_SHARE * nodes:
        return Hearing(nodes, heard, 1.0)
    stretch = MAX_STRETCH if heard == 0 else min(MAX_STRETCH, WINDOW_INTERVALS * nodes / heard)
    return Hearing(nodes, heard, stretch)


# The intake's lag is read from the late nodes the sweep has not judged yet: at least this many of them,
LATE_MIN = 3
# and at least this share of the fleet, so that a few nodes dying one after another do not count as lag.
LATE_SHARE = 0.005


def intake_lag(*, now: dt.datetime, nodes: int) -> float:
    """Seconds by which the fleet's late tail, short of the unreachable delay, trails an on-time heartbeat.

    A fleet heard by a web tier that keeps up has no node between an on-time
    heartbeat's age (WINDOW_INTERVALS intervals: agents jitter by up to 10 %)
    and the unreachable delay other than nodes that died in the last few
    seconds. A backlog puts many there: each heartbeat waits its turn, so
    while 80 % or more of the fleet is still heard within the window (no
    stretch above), its slowest nodes wait past the delay. The age of the
    k-th oldest node not yet due (k: LATE_MIN, or LATE_SHARE of `nodes` if
    more) less an on-time age is that wait; the sweep adds it to its delays.

    A node already past the delay is not among them, so nodes that died
    together are all past the delay at the same sweep and judged on time; it
    is bounded by the delay itself (the unreachable delay less an on-time
    age). The cost: k or more nodes dying one after another within the
    unreachable delay are judged when the last of them is due, up to that
    bound later. 0.0 for a fleet under MIN_NODES (one query otherwise).
    """
    if nodes < MIN_NODES:
        return 0.0
    on_time = WINDOW_INTERVALS * settings.LLMGW_HEARTBEAT_INTERVAL
    due = now - dt.timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER)
    k = max(LATE_MIN, math.ceil(LATE_SHARE * nodes))
    kth = (
        Node.objects.exclude(state=NodeState.LOST)
        .filter(unreachable_since__isnull=True, last_seen__gte=due)
        .order_by("last_seen")
        .values_list("last_seen", flat=True)[k - 1 : k]
    )
    seen = next(iter(kth), None)
    if seen is None:
        return 0.0
    return max(0.0, (now - seen).total_seconds() - on_time)
