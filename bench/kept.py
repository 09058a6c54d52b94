"""The kept placement index at 5,000 and 10,000 nodes, in a throwaway database.

The cluster is bench/metrics.py's (GB200 nodes of 8 cards in NVLink domains
of 18, 8 InfiniBand adapters each on 4 fabrics, telemetry in the cache as a
heartbeat leaves it). Measured, each several times (min / median / max, the
machine being shared): the full build every pass paid before, a reconcile
pass that places one new replica (the feed read, the reload of the node the
previous pass placed on, the lease query, the planning and the writes), and
another process's change to one node, and its claim on one (only what the
node's shards hold read again), and a dry run (the kept index brought up to
date, copied, one replica planned and reserved; and the same through the
REST endpoint, with its JSON).
Targets: a pass placing one replica at 5,000 nodes under 50 ms; a dry run
at 10,000 nodes under 100 ms.
"""

from __future__ import annotations

import os
import statistics
import time

from bench.common import StatementCounter, scratch_database
from bench.metrics import _forget, _populate

SIZES = (5000, 10000)
RUNS = 7


def _spread(times: list[float]) -> str:
    return f"{min(times) * 1000:.1f} / {statistics.median(times) * 1000:.1f} / {max(times) * 1000:.1f} ms"


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _timed_current(now, before=None) -> tuple[list[float], int]:
    """RUNS calls of kept.current(), each after `before` (a change marked): their times, the last one's statements."""
    from django.db import connection

    from placement import kept

    times, statements = [], 0
    for _ in range(RUNS):
        if before is not None:
            before()
        with StatementCounter(connection) as q:
            started = time.perf_counter()
            kept.current(now=now)
            times.append(time.perf_counter() - started)
        statements = q.count
    return times, statements


def _one_size(size: int) -> list[str]:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone
    from rest_framework.test import APIRequestFactory, force_authenticate

    from inventory import changes
    from inventory.models import Node
    from placement import kept, planner, snapshot_db
    from placement.api import DryRunView
    from placement.models import Deployment, EngineProfile
    from placement.reconciler import reconcile

    out = []
    with scratch_database(f"bench_kept_{size}"):
        now = timezone.now()
        ids = _populate(size, now)
        try:
            prof = EngineProfile.objects.create(name="bench", engine="echo", gpus_per_node=2)
            dep = Deployment.objects.create(name="bench", served_model="m", profile=prof, replicas=0)

            builds = []
            for _ in range(3):
                started = time.perf_counter()
                snapshot_db.build(now=now)
                builds.append(time.perf_counter() - started)
            out.append(f"{size:,} nodes: full build (what every pass with work paid): {_spread(builds)}")

            kept.reset()
            started = time.perf_counter()
            kept.current(now=now)
            first = time.perf_counter() - started
            out.append(
                f"{size:,} nodes: kept index, first use (a full build and its bookkeeping): {first * 1000:.0f} ms"
            )

            passes, statements = [], []
            for k in range(RUNS):
                Deployment.objects.filter(id=dep.id).update(replicas=k + 1)
                with StatementCounter(connection) as q:
                    started = time.perf_counter()
                    report = reconcile(now=now)
                    passes.append(time.perf_counter() - started)
                assert report.placed == 1, report
                statements.append(q.count)
            index = kept.index()
            out.append(
                f"{size:,} nodes: reconcile pass placing one replica: {_spread(passes)} "
                f"(target < 50 ms at 5,000), {statistics.median(statements):.0f} statements, "
                f"{index.rebuilds} rebuild(s) in all, {index.reloaded} node reload(s)"
            )

            current, current_statements = _timed_current(now)
            out.append(
                f"{size:,} nodes: kept.current() with nothing changed (the feed's round trip, the lease's query): "
                f"{_spread(current)}, {current_statements} statement(s)"
            )
            one = ids[len(ids) // 2]
            reload_, _ = _timed_current(now, before=lambda: changes.mark([one]))
            out.append(f"{size:,} nodes: kept.current() after another process changed one node: {_spread(reload_)}")
            # Another process's claim on one node: its holdings alone are read again (changes.HOLDINGS).
            held, held_statements = _timed_current(now, before=lambda: changes.mark([one], holdings=True))
            out.append(
                f"{size:,} nodes: kept.current() after another process's claim on one node (its holdings read "
                f"again): {_spread(held)}, {held_statements} statement(s)"
            )

            req = planner.ReplicaRequest(gpus_per_node=2)
            dry, copies, explained = [], [], []
            for _ in range(RUNS):
                started = time.perf_counter()
                snap = kept.scratch(now=now)
                copied = time.perf_counter()
                result = planner.plan(req, snap)
                snap.reserve(result)
                dry.append(time.perf_counter() - started)
                copies.append(copied - started)
                started = time.perf_counter()
                planner.plan(req, snap, explain=True)
                explained.append(time.perf_counter() - started)
            out.append(
                f"{size:,} nodes: dry run of one replica (update, copy, plan, reserve): {_spread(dry)}; "
                f"of which the update and copy {_spread(copies)}"
            )
            out.append(
                f"{size:,} nodes: the planner's explain=True (a reason for every node, as the endpoint asks): "
                f"{_spread(explained)}"
            )

            user = User.objects.create_superuser("bench", password="x")
            # The endpoint plans at the wall clock: every node heard from just now, as heartbeats keep
            # them (at 10,000 nodes the set-up outlasts a lease, and every node would be refused as silent).
            Node.objects.update(last_seen=timezone.now())
            factory, view = APIRequestFactory(), DryRunView.as_view()
            for body, what in (
                ({}, "the reasons summarised, the default"),
                ({"explain": "all"}, "every node's reason too, explain all"),
            ):
                api = []
                for _ in range(RUNS):
                    request = factory.post(
                        "/api/v1/placement/dry-run/", {"profile": prof.id, "replicas": 1, **body}, format="json"
                    )
                    force_authenticate(request, user=user)
                    started = time.perf_counter()
                    response = view(request)
                    response.render()
                    api.append(time.perf_counter() - started)
                    assert response.status_code == 200, response.content[:300]
                out.append(
                    f"{size:,} nodes: dry run through the REST endpoint, {what} (JSON in and out, "
                    f"{len(response.content):,} bytes): {_spread(api)} (target < 100 ms at 10,000)"
                )
        finally:
            _forget(ids)
            kept.reset()
    return out


def run() -> list[str]:
    """The kept index's figures at each size, with the machine's load average when measured."""
    import django

    django.setup()
    lines = []
    sizes = [int(s) for s in os.environ.get("LLMGW_BENCH_KEPT_SIZES", "").split(",") if s] or list(SIZES)
    for size in sizes:
        lines += _one_size(size)
        lines.append(f"(load average after {size:,} nodes: {_load()}, {os.cpu_count()} CPUs)")
    return lines
