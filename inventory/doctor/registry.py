"""The doctor's checks, in the order they run and report, and what extra each needs loaded.

The inventory registers its own (inventory/doctor/__init__.py); another app
adds checks about what it owns (placement's pending replicas) from its
AppConfig.ready(), with a loader that reads its data into the snapshot's
`extra` once per run, so the doctor stays a constant number of queries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inventory.doctor.loader import Inventory
    from inventory.doctor.results import CheckResult

Check = Callable[["Inventory"], "CheckResult"]
Loader = Callable[["Inventory"], None]

_CHECKS: list[Check] = []
_LOADERS: list[Loader] = []


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
