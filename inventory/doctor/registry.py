"""The doctor's checks, in the order they run and report, and what extra each needs loaded.

The inventory registers its own (inventory/doctor/__init__.py); another app
adds checks about what it owns (placement's pending replicas) from its
AppConfig.ready(), with a loader that reads its data into the snapshot's
`extra` once per run, so the doctor stays a constant number of queries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inventory.doctor.loader import Inventory
    from inventory.doctor.results import CheckResult, Findings

Check = Callable[["Inventory"], "CheckResult"]
Loader = Callable[["Inventory"], None]

_CHECKS: list[Check] = []
_LOADERS: list[Loader] = []


@dataclass(frozen=True)
class PerNode:
    """A check made of per-node findings and a verdict over them (see results.Findings).

    `shares`: what beyond a node's own facts its findings depend on
    ("canon": the canonical subnet managers, "scans": the fabric scans,
    "baselines": the IB counter baselines, which roll with time), so the
    kept doctor re-checks the nodes concerned when that changes.
    """

    find: Callable[[Inventory], Findings]
    verdict: Callable[[Findings, Inventory], CheckResult]
    shares: frozenset[str] = frozenset()


_PER_NODE: dict[Check, PerNode] = {}


def per_node(
    check: Check,
    *,
    find: Callable[[Inventory], Findings],
    verdict: Callable[[Findings, Inventory], CheckResult],
    shares: frozenset[str] = frozenset(),
) -> None:
    """Say that `check` is `verdict(find(inv), inv)`, node by node: the kept doctor then re-checks only changed nodes.

    A check not declared so runs whole at every refresh, over what the kept
    doctor holds (inventory/doctor/kept.py says what that is).
    """
    _PER_NODE[check] = PerNode(find, verdict, frozenset(shares))


def per_node_of(check: Check) -> PerNode | None:
    """How a check splits into per-node findings, None when it does not."""
    return _PER_NODE.get(check)


def register(check: Check, *, load: Loader | None = None) -> Check:
    """Add a check (named after its function, less `check_`) after those registered before; usable as a decorator.

    `load`, when given, runs in every full snapshot load before any check.
    Registering the same check twice is a no-op; two checks of one name are refused.
    """
    if check in _CHECKS:
        return check
    if name_of(check) in check_names():
        raise ValueError(f"a doctor check named {name_of(check)!r} is already registered")
    _CHECKS.append(check)
    if load is not None and load not in _LOADERS:
        _LOADERS.append(load)
    return check


def name_of(check: Check) -> str:
    """The name a check reports under."""
    return check.__name__.removeprefix("check_")


def checks() -> tuple[Check, ...]:
    """Every registered check, in registration order."""
    return tuple(_CHECKS)


def check_names() -> tuple[str, ...]:
    """The registered checks' names, in the order they run."""
    return tuple(name_of(c) for c in _CHECKS)


def loaders() -> tuple[Loader, ...]:
    """What the registered checks need read into a snapshot beyond the inventory's own."""
    return tuple(_LOADERS)


def run_checks(inv: Inventory) -> list[CheckResult]:
    """Every check over one snapshot, in a fixed order."""
    return [check(inv) for check in _CHECKS]
