"""The fleet's counts and latency histograms (buckets about 5% apart, 0.1 ms to 60 s)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Latency histogram: bucket upper edges in seconds, 0.1 ms to 60 s, about 5% apart.
EDGES: list[float] = []
_e = 0.0001
while _e < 60.0:
    EDGES.append(round(_e, 7))
    _e *= 1.05
EDGES.append(float("inf"))


def histogram_percentile(counts: list[int], p: float) -> float:
    """The `p`th percentile (0-100) of a histogram over EDGES: the upper edge of the bucket it falls in."""
    total = sum(counts)
    if not total:
        return 0.0
    rank = p / 100 * total
    seen = 0
    for edge, n in zip(EDGES, counts, strict=True):
        seen += n
        if seen >= rank and n:
            return edge
    return EDGES[-1]


@dataclass
class Stats:
    """What the fleet has done so far; cumulative, so two snapshots give the rates between them."""

    registered: int = 0
    # First statuses answered after registering: a node in a join storm has joined once its first is.
    first_statuses: int = 0
    register_refused: Counter = field(default_factory=Counter)
    heartbeats: int = 0
    # Of the heartbeats, those sent as leases (wire.Lease) rather than the whole status.
    leases: int = 0
    heartbeat_errors: Counter = field(default_factory=Counter)
    # Why each full status went instead of a lease (VirtualNode.status_due).
    statuses_why: Counter = field(default_factory=Counter)
    # Status floors sent as the digest of the last status (a lease), and of those the ones the
    # control plane did not confirm (it asked for the whole status, or did not check).
    floor_digests: int = 0
    floor_digests_unconfirmed: int = 0
    unreachable: int = 0
    answers_dropped: int = 0
    commands: Counter = field(default_factory=Counter)
    latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    # Of the heartbeats, the statuses that reported a change (a shard ready or ended, a fault).
    changed_latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    # Of the heartbeats, the leases the gateway answered: its path told apart from the web's.
    lease_latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    # Times the gateway's lease endpoint failed (timeout, 5xx, 404/405) and the leases of the next
    # minute went to the control plane's own endpoint; leases sent there while a gateway was named.
    lease_fallbacks: int = 0
    leases_to_control_plane: int = 0
    # Leases sent to the gateway while a status waited for its answer (llmgw_agent/keepalive.py).
    keepalives: int = 0
    register_latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    # How late each heartbeat left against when it was due: the simulator's own event loop behind
    # (short of CPU), which a real fleet, each agent on its own machine, does not have.
    lateness: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    # How long each request waited for one of the process's connections before it was sent: the
    # simulator's own queue (part of `latency`), which agents on machines of their own do not have.
    pool_wait: list[int] = field(default_factory=lambda: [0] * len(EDGES))

    def observe(self, hist: list[int], seconds: float) -> None:
        """Count one request's latency."""
        hist[bisect.bisect_left(EDGES, seconds)] += 1

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "registered": self.registered,
            "first_statuses": self.first_statuses,
            "register_refused": dict(self.register_refused),
            "heartbeats": self.heartbeats,
            "leases": self.leases,
            "keepalives": self.keepalives,
            "heartbeat_errors": dict(self.heartbeat_errors),
            "statuses_why": dict(self.statuses_why),
            "floor_digests": self.floor_digests,
            "floor_digests_unconfirmed": self.floor_digests_unconfirmed,
            "unreachable": self.unreachable,
            "answers_dropped": self.answers_dropped,
            "commands": dict(self.commands),
            "latency": list(self.latency),
            "changed_latency": list(self.changed_latency),
            "lease_latency": list(self.lease_latency),
            "lease_fallbacks": self.lease_fallbacks,
            "leases_to_control_plane": self.leases_to_control_plane,
            "register_latency": list(self.register_latency),
            "lateness": list(self.lateness),
            "pool_wait": list(self.pool_wait),
        }
