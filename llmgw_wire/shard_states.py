"""The shard state machine: the states, the moves between them, what is live and what is over.

One table for every reader and writer, beside the wire schema it speaks of: the
heartbeat path (placement/agent_sync.py),
the reconciler, the snapshot, the database constraints, the tests, and the
node agent's supervisor. It imports no Django (only the wire schema), so the
agent can import it too.
"""

from __future__ import annotations

from llmgw_wire.common import ShardState

S = ShardState

# A shard in one of these is over: a restarted process is a new shard (a new
# row), so it never becomes live again, and a report of one running again is a
# process the control plane has given up on, which is stopped, not revived.
TERMINAL: frozenset[str] = frozenset({S.STOPPED.value, S.FAILED.value})
LIVE: frozenset[str] = frozenset(s.value for s in S) - TERMINAL
# What a fence stops. A shard reported draining is being stopped already (its
# agent sent SIGTERM and SIGKILLs it at the deadline): fencing it again would
# queue a fresh StopShard with every heartbeat until it ends.
FENCEABLE: frozenset[str] = LIVE - {S.DRAINING.value}

# A start's progress before ready. The control plane acts on none of it (a replica waits for all its
# shards ready), so an agent reports it with its next heartbeat; every other change (ready, an end, a
# ready engine loading again) it reports at once. Reporting each step at once cost a full status per
# step per shard, and a scale-up of a thousand replicas became three thousand statuses in seconds.
STARTING_UP: frozenset[str] = frozenset({S.PENDING.value, S.STARTING.value, S.LOADING.value})

TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING.value: frozenset({"starting", "loading", "ready", "draining", "stopped", "failed"}),
    S.STARTING.value: frozenset({"loading", "ready", "draining", "stopped", "failed"}),
    # An engine may report loading again after ready (a reload); never back to starting or pending.
    S.LOADING.value: frozenset({"starting", "ready", "draining", "stopped", "failed"}),
    S.READY.value: frozenset({"loading", "draining", "stopped", "failed"}),
    S.DRAINING.value: frozenset({"stopped", "failed"}),
    S.STOPPED.value: frozenset(),
    # Failed by the control plane (its node was lost) while the process may still run:
    # the agent's later "stopped" tells the operator the process has really ended.
    S.FAILED.value: frozenset({"stopped"}),
}


def allowed(old: str, new: str) -> bool:
    """Whether a shard may move from `old` to `new` (never to the state it is in)."""
    return str(new) in TRANSITIONS[str(old)]


def is_live(state: str) -> bool:
    """Whether a shard in `state` is, or is becoming, a process."""
    return str(state) in LIVE


def report_at_once(old: str | None, new: str) -> bool:
    """Whether an agent reports a shard's move from `old` (None: not seen before) to `new` without waiting.

    Everything but a start's progress before ready (STARTING_UP to STARTING_UP).
    """
    return not (new in STARTING_UP and (old is None or old in STARTING_UP))
