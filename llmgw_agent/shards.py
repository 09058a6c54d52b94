"""A shard as the agent's supervisor keeps it, the moves its state may make, and its record on disk.

Each shard is recorded in the state directory (pid, the process's start
time, its argv), so an agent starting again can find it and offer it for
adoption.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llmgw_wire as wire
from llmgw_wire import shard_states

S = wire.ShardState
TRANSITIONS: dict[S, frozenset[S]] = {
    S.PENDING: frozenset({S.STARTING, S.FAILED, S.STOPPED}),
    S.STARTING: frozenset({S.LOADING, S.READY, S.FAILED, S.DRAINING}),
    S.LOADING: frozenset({S.READY, S.FAILED, S.DRAINING}),
    S.READY: frozenset({S.FAILED, S.DRAINING}),
    S.DRAINING: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}
TERMINAL = frozenset(S(s) for s in shard_states.TERMINAL)


class TransitionError(RuntimeError):
    """A shard state change that the state machine does not allow."""


def safe_name(name: str) -> str:
    """A shard id as a file name: nothing outside [A-Za-z0-9._-], at most 200 characters."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:200] or "_"


@dataclass
class Shard:
    """One shard as the supervisor keeps it (and records it in the state directory)."""

    shard_id: str
    replica_id: str = ""
    command_id: str = ""
    rank: int = 0
    gpu_indices: list[int] = field(default_factory=list)
    hcas: list[str] = field(default_factory=list)
    http_port: int | None = None
    leader_addr: str = ""
    model: str = ""
    profile: str = ""
    pool: str = ""
    fabric: str = ""
    profile_fp: str = ""
    argv: list[str] = field(default_factory=list)
    health_path: str | None = "/health"
    state: str = S.PENDING.value
    reason: str = ""
    exit_code: int | None = None
    pid: int | None = None
    proc_start: int | None = None
    started_at: float = 0.0
    startup_timeout_s: float = 1800.0
    ended_at: float | None = None
    # When a signalled process gets SIGKILL.
    kill_at: float | None = None
    adopted: bool = False

    @property
    def st(self) -> S:
        return S(self.state)


class ShardRecords:
    """The shards' records (one JSON file each) in a directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, shard_id: str) -> Path:
        """Where a shard's record lives."""
        return self.dir / f"{safe_name(shard_id)}.json"

    def write(self, shard: Shard) -> None:
        """Write a shard's record atomically (a crash leaves the old record or the new)."""
        path = self.path(shard.shard_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(shard)))
        os.replace(tmp, path)

    def remove(self, shard_id: str) -> None:
        """Forget a shard: nothing left to adopt."""
        self.path(shard_id).unlink(missing_ok=True)

    def paths(self) -> list[Path]:
        """Every record, in name order."""
        return sorted(self.dir.glob("*.json"))

    @staticmethod
    def read(path: Path) -> Shard:
        """The shard a record holds; raises OSError, ValueError or TypeError for one unreadable."""
        return Shard(**json.loads(path.read_text()))
