"""What an operator does to a node: cordon, uncordon, drain, labels, forget.

The admin's actions and the REST API call these same functions, so a cordon
from a browser and one from a script are one rule, one audit trail. What each
action will affect is a function of its own, so a confirmation page shows the
operator exactly what the action then does.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone

import llmgw_wire as wire
from inventory import changes, hooks, telemetry
from inventory.models import NODE_TRANSITIONS, Allocation, Node, NodeEvent, NodeState
from inventory.nodes import TransitionError, change_state, set_operator_labels

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

# The same rule as the wire schema's label keys, so an operator label can be
# anything an agent label can be, and nothing a selector could not match.
LABEL_KEY = re.compile(wire.LABEL_KEY_PATTERN)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?)?$")
LABEL_MAX = wire.LABEL_MAX
MAX_LABELS = wire.MAX_LABELS
# What an operator is told when a label breaks the rule above.
KEY_RULE = (
    f"a label key is 1-{LABEL_MAX} letters, digits, '.', '_', '/' or '-', starting and ending with a letter or digit"
)
VALUE_RULE = (
    f"a label value is empty, or at most {LABEL_MAX} letters, digits, '.', '_', '/' or '-', "
    "starting and ending with a letter or digit"
)


class LabelError(ValueError):
    """An operator label that cannot be stored; `field` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ForgetRefused(Exception):
    """A node that still holds allocations or shards cannot be forgotten."""


def validate_labels(labels: Mapping[str, object]) -> dict[str, str]:
    """Check operator labels: keys and values as a selector can match them.

    Raises LabelError naming the first bad key, so a form or an API answer can
    point at it.
    """
    if len(labels) > MAX_LABELS:
        raise LabelError("labels", f"at most {MAX_LABELS} labels")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key:
            raise LabelError(str(key), "a label key must be a non-empty string")
        if len(key) > LABEL_MAX or not LABEL_KEY.match(key):
            raise LabelError(key, KEY_RULE)
        if not isinstance(value, str):
            raise LabelError(key, "a label value must be a string")
        if len(value) > LABEL_MAX or not LABEL_VALUE.match(value):
            raise LabelError(key, VALUE_RULE)
        out[key] = value
    return out


def label_lines(labels: Mapping[str, str]) -> str:
    """Labels written one `key=value` a line, by key: what `parse_label_lines` reads back."""
    return "\n".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_label_lines(text: str) -> dict[str, str]:
    """Read labels written one `key=value` a line (the admin's editor); blank lines are skipped."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise LabelError(f"line {n}", f"{line!r} is not key=value")
        k, v = line.split("=", 1)
        out[k.strip()] = v.strip()
    return validate_labels(out)


@dataclass(frozen=True)
class AffectedReplica:
    """A replica with a live shard on a node: what a drain will move."""

    replica_id: str
    deployment: str
    replica_state: str
    shards: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        """How a person reads it: deployment and short id."""
        return f"{self.deployment}/{self.replica_id[:8]}"


def live_replicas(node_ids: Iterable[str]) -> dict[str, list[AffectedReplica]]:
    """The replicas that have a shard not stopped or failed on each node, by node id.

    These are what a drain moves, and until none is left the drain is not done.
    Placement answers (inventory/hooks.py): the inventory holds no replicas.
    """
    return hooks.workloads().live_replicas(node_ids)


@dataclass(frozen=True)
class Impact:
    """What an action on one node will do: whether it can, why not, and what it touches."""

    node_id: str
    state: str
    allowed: bool
    reason: str = ""
    replicas: tuple[AffectedReplica, ...] = ()


_TARGET = {"cordon": NodeState.CORDONED, "uncordon": NodeState.READY, "drain": NodeState.DRAINING}


def silence(node: Node, *, now: dt.datetime) -> str:
    """Why a node's agent counts as silent ("" when its heartbeats arrive): flagged, or past the lease."""
    if node.unreachable_since is not None:
        return f"its agent has been silent since {node.unreachable_since:%Y-%m-%d %H:%M:%S} UTC"
    if node.last_seen is None:
        return "its agent has never sent a heartbeat"
    quiet = (now - node.last_seen).total_seconds()
    if quiet > settings.LLMGW_UNREACHABLE_AFTER:
        return f"its agent has sent no heartbeat for {int(quiet)} s"
    return ""


def impact(action: str, nodes: Iterable[Node], *, now: dt.datetime | None = None) -> list[Impact]:
    """What `action` (cordon, uncordon, drain) would do to each node, for a confirmation page.

    Uncordon only releases an operator's hold: an unreachable node comes back
    by heartbeat, not by an operator saying so, and a cordoned or draining
    node whose agent is silent stays out of placement (otherwise cordon then
    uncordon would make a dead node schedulable).
    """
    now = now or timezone.now()
    target = _TARGET[action]
    nodes = list(nodes)
    live = live_replicas(n.id for n in nodes) if action == "drain" else {}
    out = []
    for n in nodes:
        state = NodeState(n.state)
        quiet = silence(n, now=now) if target == NodeState.READY else ""
        if state == target:
            allowed, reason = False, f"already {state}"
        elif action == "uncordon" and state not in (NodeState.CORDONED, NodeState.DRAINING):
            # Only unreachable or lost get here (ready is "already ready"): their heartbeat brings them back.
            allowed, reason = (
                False,
                f"{state} is not an operator's hold: it returns to ready when its heartbeats resume",
            )
        elif quiet:
            allowed, reason = False, f"{quiet}: it can be uncordoned once its heartbeats resume"
        elif target not in NODE_TRANSITIONS[state]:
            allowed, reason = False, f"{state} cannot become {target}"
        else:
            allowed, reason = True, ""
        out.append(Impact(n.id, str(state), allowed, reason, tuple(live.get(n.id, ()))))
    return out


def _act(action: str, node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None, reason: str = "") -> NodeState:
    with transaction.atomic():
        # Locked, so a sweep marking it silent cannot slip between the check and the move.
        node = Node.objects.select_for_update().only("id", "state", "last_seen", "unreachable_since").get(id=node_id)
        (verdict,) = impact(action, [node], now=now)
        if not verdict.allowed:
            raise TransitionError(f"node {node_id}: {verdict.reason}")
        why = reason or f"{action} by {actor.get_username() if actor is not None else 'system'}"
        if not change_state(node_id, _TARGET[action], now=now, expected=verdict.state, reason=why, actor=actor):
            raise TransitionError(f"node {node_id} changed state meanwhile; look again")
    return _TARGET[action]


def cordon(node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None, reason: str = "") -> NodeState:
    """Exclude a node from new placement; what runs there keeps running."""
    return _act("cordon", node_id, now=now, actor=actor, reason=reason)


def uncordon(node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None, reason: str = "") -> NodeState:
    """Give a cordoned or draining node back to placement."""
    return _act("uncordon", node_id, now=now, actor=actor, reason=reason)


def drain(node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None, reason: str = "") -> NodeState:
    """Move a node's replicas off it: the reconciler rebuilds each elsewhere before stopping it here."""
    return _act("drain", node_id, now=now, actor=actor, reason=reason)


@dataclass(frozen=True)
class DrainProgress:
    """Where a drain stands: the replicas still to move, and whether the node is empty."""

    node_id: str
    draining: bool
    remaining: tuple[AffectedReplica, ...]

    @property
    def done(self) -> bool:
        """Nothing left to move."""
        return not self.remaining


def drain_progress(node: Node) -> DrainProgress:
    """The replicas a draining node still holds."""
    remaining = live_replicas([node.id])[node.id]
    return DrainProgress(node.id, node.state == NodeState.DRAINING, tuple(remaining))


def change_labels(
    node_id: str, labels: Mapping[str, object], *, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> dict[str, str]:
    """Replace a node's operator labels after validating them; returns the effective labels."""
    return set_operator_labels(node_id, validate_labels(labels), now=now, actor=actor)


def patch_labels(
    node_id: str, changes: Mapping[str, object | None], *, now: dt.datetime, actor: AbstractBaseUser | None = None
) -> dict[str, str]:
    """Set some operator labels and remove those given as None (the agent's value then shows again)."""
    with transaction.atomic():
        node = Node.objects.select_for_update().only("id", "operator_labels").get(id=node_id)
        labels = dict(node.operator_labels)
        for k, v in changes.items():
            if v is None:
                labels.pop(k, None)
            else:
                labels[k] = v  # type: ignore[assignment]
        return change_labels(node_id, labels, now=now, actor=actor)


def forget_refusal(node: Node) -> str:
    """Why a node cannot be forgotten, "" when it can.

    A node holding allocations or shards not over is still part of some
    replica: its rows are what tells the reconciler there is something to
    rebuild. Stopped and failed shards hold nothing and do not count.
    """
    allocations = Allocation.objects.filter(node_id=node.id).count()
    shards = hooks.workloads().shard_count(node.id)
    parts = []
    if allocations:
        parts.append(f"{allocations} allocation{'s' if allocations != 1 else ''}")
    if shards:
        parts.append(f"{shards} shard{'s' if shards != 1 else ''} not stopped")
    return f"{node.id} still holds " + " and ".join(parts) if parts else ""


def forget(node_id: str, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> None:
    """Remove a node that is gone for good, its hardware rows and its telemetry, keeping its history.

    Refused (ForgetRefused) while it holds allocations or shards not over.
    Its events stay, naming it, with a last one saying who forgot it; its
    stopped and failed shards go (placement keeps their events).
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().get(id=node_id)
        refusal = forget_refusal(node)
        if refusal:
            raise ForgetRefused(refusal)
        hooks.workloads().forget_node(node_id)
        node.delete()
        NodeEvent.objects.create(
            node=None,
            node_name=node_id,
            at=now,
            kind="forgotten",
            actor=actor,
            actor_name=actor.get_username() if actor is not None else "system",
            message=f"forgotten (was {node.state})",
        )
        changes.mark([node_id])
    telemetry.forget(node_id)
