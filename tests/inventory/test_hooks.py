"""The inventory's hooks: placement fills them at start-up, and a missing one fails loudly."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from inventory import hooks
from placement import workloads


def test_placement_registers_its_workloads_at_start_up():
    assert hooks.workloads() is workloads.WORKLOADS


def test_a_missing_registration_raises_rather_than_answering_nothing(monkeypatch):
    monkeypatch.setattr(hooks, "_workloads", None)
    with pytest.raises(ImproperlyConfigured, match="placement"):
        hooks.workloads()


def test_a_second_different_registration_is_refused():
    hooks.register_workloads(workloads.WORKLOADS)  # the same one again: harmless
    with pytest.raises(ImproperlyConfigured):
        hooks.register_workloads(workloads.PlacementWorkloads())
