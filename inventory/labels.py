"""Node labels: the agent's own, and the operator's laid over them."""

from __future__ import annotations

from collections.abc import Mapping


def merge(agent: Mapping[str, str] | None, operator: Mapping[str, str] | None) -> dict[str, str]:
    """The effective labels: the agent's overlaid by the operator's.

    Kept as two maps so that an operator's label, once removed, brings the
    agent's value back instead of leaving the key unset.
    """
    out = dict(agent or {})
    out.update(operator or {})
    return out


def matches(labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    """Whether every key of a selector is present with the same value."""
    return all(labels.get(k) == v for k, v in (selector or {}).items())
