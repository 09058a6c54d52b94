"""The doctor's check registry: the inventory's checks, then those other apps add, names unique."""

from __future__ import annotations

import pytest

from inventory import doctor
from inventory.doctor import registry


def test_a_check_registers_once_and_a_name_only_once(monkeypatch):
    monkeypatch.setattr(registry, "_CHECKS", list(registry._CHECKS))
    before = doctor.check_names()
    doctor.register(doctor.check_imex)
    assert doctor.check_names() == before

    def check_imex(inv):  # another function under a taken name
        raise AssertionError("never run")

    with pytest.raises(ValueError, match="imex"):
        doctor.register(check_imex)


def test_the_inventory_checks_come_first_in_their_fixed_order():
    assert doctor.check_names()[:3] == ("control_plane_liveness", "nodes_reachable", "clock_skew")
    assert "replicas_pending" in doctor.check_names()
