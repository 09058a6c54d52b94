"""The autoscaler's step of a reconcile pass: signals in, replica counts out, each step an event.

Run by the reconciler under its lock, so the decision is made once however
many workers and gateways there are, from the signals every gateway process
shares (placement/inflight.py, placement/demand.py). The decision itself is
placement/autoscale.py's pure function; this module reads, records and sets.
A scale-up is an ordinary new replica the planner places; a scale-down is
an ordinary retirement, drained first (the reconciler's scale step picks
which replica goes).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from placement import autoscale, demand, inflight, replicas
from placement.models import AutoscaleSample, Deployment
from placement.retiring import SERVING, LiveReplica

# How long the samples are kept: the chart's span, and far longer than any window.
KEEP = dt.timedelta(days=1)


@dataclass(frozen=True)
class Step:
    """A change of a deployment's replica count, as the pass made it."""

    deployment_id: int
    before: int
    after: int
    reason: str


def _history(deps: list[Deployment], now: dt.datetime) -> dict[int, list[autoscale.Sample]]:
    """Each deployment's recommendations over its longest window, and the one in effect before it: one query."""
    longest = max(max(d.scale_up_window_s, d.scale_down_window_s) for d in deps)
    # A pass or two before the window's start, so the sample in effect at its start is there.
    margin = max(60.0, 3 * settings.LLMGW_RECONCILE_INTERVAL)
    since = now - dt.timedelta(seconds=longest + margin)
    out: dict[int, list[autoscale.Sample]] = defaultdict(list)
    for dep_id, at, rec in AutoscaleSample.objects.filter(
        deployment_id__in=[d.id for d in deps], at__gte=since, at__lte=now
    ).values_list("deployment_id", "at", "recommended"):
        out[dep_id].append(autoscale.Sample(at, rec))
    return out


def counted(reps: list[LiveReplica]) -> list[LiveReplica]:
    """The replicas that count toward a deployment's number: not draining, not being replaced."""
    replaced = {r.row.replaces_id for r in reps if r.row.replaces_id}
    return [r for r in reps if r.row.id not in replaced]


def apply(deployments: dict[int, Deployment], by_dep: dict[int, list[LiveReplica]], *, now: dt.datetime) -> list[Step]:
    """Decide every autoscaled deployment's count, record a sample each, and set the counts that change.

    `by_dep` holds the live replicas that are not draining. A count is set by
    compare-and-set, so an operator's change made meanwhile wins and this
    pass's decision is dropped. Sets `replicas` on the deployments in
    `deployments`, so the pass's scale step acts on it at once.
    """
    auto = [d for d in deployments.values() if d.autoscaled]
    if not auto:
        return []
    routers = inflight.totals()
    wanted = demand.totals()
    history = _history(auto, now)
    samples: list[AutoscaleSample] = []
    steps: list[Step] = []
    for dep in auto:
        reps = by_dep.get(dep.id, [])
        mine = counted(reps)
        signals = autoscale.Signals(
            inflight=sum(routers.per_replica.get(str(r.row.id), 0) for r in reps),
            waiting=wanted.waiting(dep.served_model),
            ttft_p95_s=wanted.ttft_p95(dep.served_model),
            held=wanted.held(dep.served_model),
        )
        starting = sum(1 for r in mine if r.row.state not in SERVING)
        d = autoscale.decide(
            autoscale.Policy.of(dep), signals, dep.replicas, history.get(dep.id, []), now=now, starting=starting
        )
        samples.append(
            AutoscaleSample(
                deployment_id=dep.id,
                at=now,
                replicas=dep.replicas,
                desired=d.desired,
                recommended=d.recommended,
                signal=d.signal,
                inflight=signals.inflight,
                held=signals.held,
            )
        )
        if d.desired != dep.replicas and _set(dep, d, now=now):
            steps.append(Step(dep.id, samples[-1].replicas, d.desired, d.reason))
    AutoscaleSample.objects.bulk_create(samples)
    # By deployment, so the (deployment, at) index finds them: a scan of every sample each pass would not do.
    AutoscaleSample.objects.filter(deployment_id__in=[d.id for d in auto], at__lt=now - KEEP).delete()
    return steps


def _set(dep: Deployment, d: autoscale.Decision, *, now: dt.datetime) -> bool:
    """Set the count if nobody changed it since the pass read it, with its event; True when set."""
    with transaction.atomic():
        n = Deployment.objects.filter(id=dep.id, replicas=dep.replicas, paused=False).update(
            replicas=d.desired, updated_at=now
        )
        if not n:
            return False
        replicas.event("autoscaled", now=now, deployment_id=dep.id, reason=d.reason).save()
    dep.replicas = d.desired
    return True
