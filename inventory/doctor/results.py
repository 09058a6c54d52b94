"""What a check answers, and the verdict over many."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Result(StrEnum):
    """A check's verdict."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


_SEVERITY = {Result.PASS: 0, Result.WARN: 1, Result.FAIL: 2}


@dataclass
class CheckResult:
    """One check's answer: its verdict, the nodes it concerns, what it found and what to do."""

    name: str
    result: Result
    summary: str
    action: str = ""
    nodes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-able data."""
        d = asdict(self)
        d["result"] = str(self.result)
        return d


def verdict(name: str, found: dict[str, list[str]], *, fails: set[str], ok: str, bad: str, action: str) -> CheckResult:
    """Build a result from per-node findings; nodes in `fails` make it a failure, others a warning."""
    if not found:
        return CheckResult(name, Result.PASS, ok)
    result = Result.FAIL if fails & set(found) else Result.WARN
    nodes = sorted(found)
    details = [f"{n}: {d}" for n in nodes for d in found[n]]
    return CheckResult(name, result, bad.format(n=len(nodes)), action, nodes, details)


@dataclass
class Findings:
    """What a per-node check found, node by node, before it is made a verdict.

    `found`: each node's details, in the order the check found them; `fails`:
    the nodes that make it a failure; `flags`: what else the verdict reads of
    a node (an action it calls for, a fabric it is on). A node's entries
    depend on that node's facts alone (and on what the whole snapshot shares:
    the canonical subnet managers, the scans), which is what lets the kept
    doctor re-check a few nodes and merge (`replace`).
    """

    found: dict[str, list[str]] = field(default_factory=dict)
    fails: set[str] = field(default_factory=set)
    flags: dict[str, set[str]] = field(default_factory=dict)

    def flag(self, node_id: str, what: str) -> None:
        """Note something the verdict reads about a node."""
        self.flags.setdefault(node_id, set()).add(what)

    def replace(self, node_ids: Iterable[str], other: Findings) -> None:
        """Drop what was found on these nodes and take `other`'s findings (about those nodes) instead."""
        for n in node_ids:
            self.found.pop(n, None)
            self.fails.discard(n)
            self.flags.pop(n, None)
        self.found.update(other.found)
        self.fails |= other.fails
        self.flags.update(other.flags)


def overall(results: Iterable[CheckResult]) -> Result:
    """The worst verdict among the results (pass when there are none)."""
    worst = Result.PASS
    for r in results:
        if _SEVERITY[r.result] > _SEVERITY[worst]:
            worst = r.result
    return worst


def report(results: list[CheckResult], *, now: dt.datetime) -> dict[str, Any]:
    """The doctor's answer as JSON-able data (the API's and `doctor --json`'s shape)."""
    return {"at": now.isoformat(), "result": str(overall(results)), "checks": [r.as_dict() for r in results]}
