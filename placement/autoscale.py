"""The autoscaler's decision: how many replicas a deployment should have now, and why.

A pure function over the policy, the signals the gateways share, the
recommendations of earlier passes and `now`, in the manner of Kubernetes'
HPA: each pass recommends a count from the load alone (the current count
times the metric over its target, with a tolerance of 10 % so a load near
the target changes nothing); a scale-up takes the lowest recommendation of
the scale-up window and a scale-down the highest of the scale-down window,
so the load must have stayed high (or low) for the whole window before the
count moves, and a brief dip or spike never flaps the replicas. A window
is honoured only once the history covers it: a control plane that just
started does not scale down on its first look.

Two exceptions, both bounded: a deployment at zero replicas with a request
waiting for it starts one at once (the request is held meanwhile, and no
window can make it wait longer), and a count outside the policy's bounds
is brought inside them at once.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

from placement.models import AutoscaleMetric, Deployment

# A load within this share of the target recommends the current count (the HPA's default).
TOLERANCE = 0.1


@dataclass(frozen=True)
class Policy:
    """A deployment's autoscaling policy, apart from its row."""

    metric: str
    minimum: int
    maximum: int
    target: float
    up_window_s: float = 0.0
    down_window_s: float = 300.0

    @classmethod
    def of(cls, dep: Deployment) -> Policy:
        """The policy a deployment's columns say."""
        return cls(
            metric=dep.autoscale_metric,
            minimum=dep.autoscale_min,
            maximum=dep.autoscale_max,
            target=dep.autoscale_target,
            up_window_s=float(dep.scale_up_window_s),
            down_window_s=float(dep.scale_down_window_s),
        )


@dataclass(frozen=True)
class Signals:
    """What the gateways saw of one deployment, summed over every gateway process.

    `waiting` is the engines' own queue summed over the replicas (None: no
    engine reported one); `ttft_p95_s` is None when no request got its first
    token lately; `held` counts requests a gateway holds because the model
    has no replica ready.
    """

    inflight: int = 0
    waiting: float | None = None
    ttft_p95_s: float | None = None
    held: int = 0

    @property
    def idle(self) -> bool:
        """Nothing in flight, nothing waiting, nothing held."""
        return self.inflight == 0 and self.held == 0 and not self.waiting


@dataclass(frozen=True)
class Sample:
    """One earlier pass's recommendation."""

    at: dt.datetime
    recommended: int


@dataclass(frozen=True)
class Decision:
    """What a pass decided: the count to set, what the load alone asked, the metric's value, and why."""

    desired: int
    recommended: int
    signal: float | None
    # Empty when the count stays.
    reason: str = ""


def signal_value(policy: Policy, s: Signals, current: int) -> float | None:
    """The metric's value as the policy reads it (per replica for inflight and queue); None when unmeasured."""
    per = max(current, 1)
    if policy.metric == AutoscaleMetric.INFLIGHT:
        return (s.inflight + s.held) / per
    if policy.metric == AutoscaleMetric.QUEUE:
        return None if s.waiting is None else s.waiting / per
    return s.ttft_p95_s


def _clamp(n: int, policy: Policy) -> int:
    return max(policy.minimum, min(policy.maximum, n))


def recommend(policy: Policy, s: Signals, current: int) -> int:
    """The count the load alone asks for, within the policy's bounds.

    Idle asks for the minimum (0 when allowed). At zero replicas any demand
    asks for at least one (requests in flight over the target for inflight).
    An unmeasured metric under load keeps the count; a replica count under
    load never drops to zero.
    """
    if s.idle:
        return _clamp(0, policy)
    if current == 0:
        if policy.metric == AutoscaleMetric.INFLIGHT:
            return _clamp(max(1, math.ceil((s.inflight + s.held) / policy.target)), policy)
        return _clamp(1, policy)
    value = signal_value(policy, s, current)
    if value is None:
        return _clamp(current, policy)
    ratio = value / policy.target
    if abs(ratio - 1.0) <= TOLERANCE:
        return _clamp(current, policy)
    return _clamp(max(1, math.ceil(current * ratio - 1e-9)), policy)


def describe(policy: Policy, value: float | None, *, up: bool) -> str:
    """The signal against its target, in an operator's words ("TTFT p95 1.8 s > 1.0 s")."""
    if value is None:
        return "no measurement"
    op = ">" if up else "<"
    if policy.metric == AutoscaleMetric.INFLIGHT:
        return f"{value:.1f} requests in flight per replica {op} {policy.target:g}"
    if policy.metric == AutoscaleMetric.QUEUE:
        return f"{value:.1f} requests waiting per replica {op} {policy.target:g}"
    return f"TTFT p95 {value:.1f} s {op} {policy.target:.1f} s"


def _in_effect(history: Sequence[Sample], now: dt.datetime, window_s: float) -> list[int] | None:
    """The recommendations that held over the window (None when the history does not reach back that far).

    A sample holds from its time until the next one, so the one in effect at
    the window's start counts too.
    """
    if window_s <= 0:
        return []
    start = now - dt.timedelta(seconds=window_s)
    before = [h for h in history if h.at <= start]
    if not before:
        return None
    recs = [h.recommended for h in history if h.at > start]
    if before:
        recs.append(max(before, key=lambda h: h.at).recommended)
    return recs


def _streak_s(history: Sequence[Sample], now: dt.datetime, beyond) -> float:
    """How long the recommendations have been beyond the current count without a break, up to now."""
    since = now
    for h in sorted(history, key=lambda h: h.at, reverse=True):
        if not beyond(h.recommended):
            break
        since = h.at
    return (now - since).total_seconds()


def decide(
    policy: Policy,
    signals: Signals,
    current: int,
    history: Sequence[Sample],
    *,
    now: dt.datetime,
    starting: int = 0,
) -> Decision:
    """How many replicas now, from the policy, the signals, earlier recommendations and the current count.

    `current` is the count last set; `history` holds earlier passes'
    recommendations (any order; older than the windows is ignored);
    `starting` counts replicas not serving yet (pending, placing, starting).
    While one is, no further scale-up is made: its capacity is not in the
    signal yet, and a replica no node can take must not breed more of itself.
    """
    rec = recommend(policy, signals, current)
    value = signal_value(policy, signals, current)

    def moved(desired: int, why: str) -> Decision:
        return Decision(desired, rec, value, f"{why}: {current} -> {desired} replicas")

    if current < policy.minimum:
        return moved(policy.minimum, f"below the minimum of {policy.minimum}")
    if current > policy.maximum:
        return moved(policy.maximum, f"above the maximum of {policy.maximum}")
    if rec > current:
        if current == 0:
            waiting = signals.held + signals.inflight
            return moved(rec, f"{waiting} requests waiting at zero replicas")
        recs = _in_effect(history, now, policy.up_window_s)
        if recs is None or starting:
            return Decision(current, rec, value)
        target = min([*recs, rec])
        if target <= current:
            return Decision(current, rec, value)
        held = _streak_s(history, now, lambda r: r > current)
        lasting = f" for {held:.0f} s" if held >= 1 else ""
        return moved(target, describe(policy, value, up=True) + lasting)
    if rec < current:
        recs = _in_effect(history, now, policy.down_window_s)
        if recs is None:
            return Decision(current, rec, value)
        target = max([*recs, rec])
        if target >= current:
            return Decision(current, rec, value)
        held = _streak_s(history, now, lambda r: r < current)
        lasting = f" for {held:.0f} s" if held >= 1 else ""
        if target == 0:
            return moved(0, f"no requests{lasting}")
        return moved(target, describe(policy, value, up=False) + lasting)
    return Decision(current, rec, value)
