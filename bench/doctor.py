"""The doctor's refresh, full and incremental, at 1,000 and 10,000 nodes, in a throwaway database.

The cluster is bench/metrics.py's (GB200 nodes of 8 cards in NVLink domains
of 18, 8 InfiniBand adapters each on 4 scanned fabrics, telemetry in the
cache as a heartbeat leaves it). Measured, three runs each (min / median /
max, the machine being shared), in the CPU seconds of the process that
refreshes (the worker's share; the database's and the cache's are theirs)
and in wall-clock seconds:

- a full run (what every refresh cost before, and what the kept doctor does
  on its first use, on a gap in the feed and every LLMGW_DOCTOR_FULL_S);
- a refresh with nothing changed (the feed's round trip, every node's row,
  what the fleet shares);
- a refresh after 10 and after 1 % of the nodes sent a heartbeat whose
  telemetry changed in what the doctor reads (an error counter rose), marked
  as the heartbeat marks it;
- the refreshes, every 10 s, through the half window over which the
  nodes' counter baselines roll (each node's phase: doctor/infiniband.py;
  the error-counter check alone looks again at the nodes due), with the
  nodes each one rolled.

And what the heartbeat pays to tell: `changes.mark_telemetry` on an 8-port,
8-card entry that did not change, with the doctor's view and without.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import time
import timeit

from bench.common import StatementCounter, scratch_database
from bench.metrics import _forget, _populate

SIZES = (1000, 10000)
RUNS = 3


def _spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    v = [x * scale for x in values]
    return f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f} {unit}"


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _measure(fn) -> tuple[float, float, int]:
    """CPU seconds of this process, wall seconds and statements of one call."""
    from django.db import connection

    with StatementCounter(connection) as q:
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - cpu, time.perf_counter() - wall, q.count


def _line(what: str, samples: list[tuple[float, float, int]], extra: str = "") -> str:
    cpu = [s[0] for s in samples]
    wall = [s[1] for s in samples]
    return f"{what}: CPU {_spread(cpu)}, wall {_spread(wall)}, {samples[-1][2]} statements{extra} (load {_load()})"


def _rising(node: str, k: int) -> None:
    """A heartbeat from `node` whose symbol-error counter rose by `k`: stored and marked as the heartbeat does."""
    from inventory import changes, telemetry

    previous = telemetry.get(node)
    entry = {**previous, "ib_ports": [dict(p) for p in previous["ib_ports"]]}
    first = entry["ib_ports"][0]
    first["counters"] = {**first["counters"], "symbol_error": first["counters"]["symbol_error"] + k}
    telemetry.put(node, entry)
    changes.mark_telemetry(node, previous, entry)


def _heartbeat_cost(node: str) -> list[str]:
    from inventory import changes, doctor_view, telemetry

    entry = telemetry.get(node)
    same = {**entry, "at": entry["at"] + 5, "agent_at": entry["agent_at"] + 5}
    n = 2000
    both = min(timeit.repeat(lambda: changes.mark_telemetry(node, entry, same), number=n, repeat=5)) / n
    view = min(timeit.repeat(lambda: doctor_view.view(entry) == doctor_view.view(same), number=n, repeat=5)) / n
    return [
        f"changes.mark_telemetry on an unchanged 8-port, 8-card entry: {both * 1e6:.1f} µs a heartbeat, "
        f"of which the doctor's view {view * 1e6:.1f} µs (load {_load()})"
    ]


def _one_size(size: int, *, last: bool) -> list[str]:
    from django.utils import timezone

    from inventory import doctor
    from inventory.doctor import kept
    from inventory.models import Node

    out: list[str] = []
    with scratch_database(f"bench_doctor_{size}"):
        now = timezone.now()
        ids = _populate(size, now)
        try:
            # The counter baselines the first run writes: a warm-up, as every later run finds them.
            doctor.run(now=now)
            fulls = []
            for _ in range(RUNS):
                kept.reset()
                fulls.append(_measure(lambda: kept.refresh(now=now)))
            out.append(_line(f"{size:,} nodes: full run", fulls))

            idle = [_measure(lambda: kept.refresh(now=now)) for _ in range(RUNS)]
            out.append(_line(f"{size:,} nodes: refresh, nothing changed", idle))

            step = 0
            for count in sorted({10, size // 100}):
                runs = []
                for _ in range(RUNS):
                    step += 1
                    for i in range(count):
                        _rising(ids[(i * 7919 + step) % size], step)
                    runs.append(_measure(lambda: kept.refresh(now=now)))
                assert kept.kept().last and kept.kept().full_runs == 1, (kept.kept().last, kept.kept().full_runs)
                out.append(_line(f"{size:,} nodes: refresh after {count:,} nodes' counters rose", runs))

            # The baselines roll spread over half a window (each node's phase): refreshes every 10 s through
            # the second half of the first window, as the worker's are, each rolling the nodes then due.
            rolls, counts = [], []
            start = kept.kept().rolled
            half = doctor.COUNTER_WINDOW / 2
            for k in range(1, int(half.total_seconds() // 10) + 2):
                later = now + half + k * dt.timedelta(seconds=10)
                # Heard from just now, as heartbeats keep them: no node is silent.
                Node.objects.update(last_seen=later)
                rolled = kept.kept().rolled
                rolls.append(_measure(lambda at=later: kept.refresh(now=at)))
                counts.append(kept.kept().rolled - rolled)
            assert kept.kept().rolled - start == size, (kept.kept().rolled - start, size)
            out.append(
                _line(
                    f"{size:,} nodes: refreshes every 10 s while the baselines roll ({len(counts)}, "
                    f"{min(counts)} / {statistics.median(counts):g} / {max(counts)} nodes rolled each)",
                    rolls,
                )
            )
            check = kept.refresh(now=later) == doctor.run(now=later)
            out.append(f"{size:,} nodes: the last refresh equals a full run at the same moment: {check}")
            if last:
                out += _heartbeat_cost(ids[0])
        finally:
            _forget(ids)
            kept.reset()
    return out


def run() -> list[str]:
    """The doctor's refresh figures at each size, with the load average beside each."""
    import django

    django.setup()
    lines = []
    sizes = [int(s) for s in os.environ.get("LLMGW_BENCH_DOCTOR_SIZES", "").split(",") if s] or list(SIZES)
    for i, size in enumerate(sizes):
        lines += _one_size(size, last=i == len(sizes) - 1)
    lines.append(f"({os.cpu_count()} CPUs)")
    return lines
