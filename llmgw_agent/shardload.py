"""Each shard's use of the host: cores busy and resident memory, from /proc.

An engine is more than its first process: vLLM and SGLang fork a worker per GPU,
and those workers do the work. The supervisor starts every engine in its own
session, so a shard is all the processes whose session id is its leader's.

Cores busy is a rate, so it needs two samples: the CPU ticks the session had
used at each, divided by the clock-tick rate and the seconds between them. Each
process counts its own ticks (utime + stime) and those of the children it has
reaped (cutime + cstime): a worker that exits and is reaped inside the session
moves its ticks to its parent instead of taking them out of the sum. The first
sample of a shard says 0 cores (not yet measured), and a sum that shrinks (a
process reaped outside the session) counts as 0, never negative.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import llmgw_wire as wire


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the shard load needs (ticks and pages)."""

    pid: int
    session: int
    ticks: int  # utime + stime + cutime + cstime
    rss_pages: int


def parse_stat(text: str) -> ProcStat | None:
    """One /proc/<pid>/stat line; None if it is not one.

    The command name (field 2) sits in parentheses and may itself hold spaces and
    parentheses, so the fields are counted from the last ')'.
    """
    head, sep, tail = text.rpartition(")")
    if not sep or "(" not in head:
        return None
    rest = tail.split()
    # rest[0] is field 3 (state): session is field 6, utime..cstime 14-17, rss 24 (proc(5)).
    try:
        return ProcStat(
            pid=int(head.split("(", 1)[0]),
            session=int(rest[3]),
            ticks=int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14]),
            rss_pages=int(rest[21]),
        )
    except (ValueError, IndexError):
        return None


def read_stats(proc: Path) -> list[ProcStat]:
    """Every process's stat under `proc` (a process that exits while being read is skipped)."""
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = parse_stat((entry / "stat").read_text())
        except OSError:
            continue
        if stat is not None:
            out.append(stat)
    return out


@dataclass(frozen=True)
class Sample:
    """The CPU ticks each shard's session had used, and when (monotonic seconds)."""

    at: float
    ticks: dict[str, int] = field(default_factory=dict)


def shard_loads(
    pids: dict[str, int],
    stats: list[ProcStat],
    *,
    previous: Sample | None,
    now: float,
    clock_ticks: int,
    page_size: int,
) -> tuple[dict[str, wire.ShardLoad], Sample]:
    """Each shard's cores busy since `previous` and its resident memory; with this sample.

    `pids` maps a shard to its engine's leader process; the shard is every process in
    that leader's session. A shard whose leader is gone is left out. Resident memory
    is summed over the session, so pages the processes share count once per process.
    """
    by_pid = {s.pid: s for s in stats}
    by_session: dict[int, list[ProcStat]] = {}
    for s in stats:
        by_session.setdefault(s.session, []).append(s)
    loads: dict[str, wire.ShardLoad] = {}
    ticks: dict[str, int] = {}
    elapsed = now - previous.at if previous is not None else 0.0
    for shard_id, pid in sorted(pids.items()):
        leader = by_pid.get(pid)
        if leader is None:
            continue
        members = by_session.get(leader.session, [leader])
        ticks[shard_id] = sum(m.ticks for m in members)
        cores = 0.0
        before = previous.ticks.get(shard_id) if previous is not None else None
        if before is not None and elapsed > 0 and clock_ticks > 0:
            cores = round(max(0, ticks[shard_id] - before) / clock_ticks / elapsed, 3)
        loads[shard_id] = wire.ShardLoad(cpu_cores=cores, rss_bytes=sum(m.rss_pages for m in members) * page_size)
    return loads, Sample(at=now, ticks=ticks)


class ShardMeter:
    """Keeps the previous sample between heartbeats, reading the live /proc (or `proc`)."""

    def __init__(self, *, proc: str | Path = "/proc") -> None:
        self.proc = Path(proc)
        self.previous: Sample | None = None

    def measure(self, pids: dict[str, int], *, now: float | None = None) -> dict[str, wire.ShardLoad]:
        """Each running shard's load now; cores busy are averaged since the last call."""
        if not pids:
            return {}
        loads, self.previous = shard_loads(
            pids,
            read_stats(self.proc),
            previous=self.previous,
            now=time.monotonic() if now is None else now,
            clock_ticks=os.sysconf("SC_CLK_TCK"),
            page_size=os.sysconf("SC_PAGE_SIZE"),
        )
        return loads
