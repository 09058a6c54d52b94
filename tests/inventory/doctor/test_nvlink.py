"""The doctor's NVLink checks: fabric membership, bandwidth, health, domains, IMEX."""

from __future__ import annotations

import pytest

from inventory import doctor
from inventory.doctor import Result
from inventory.models import Node
from tests.factories import gpu_payload, make_node
from tests.inventory.doctor.helpers import CLUSTER, JOINED, assert_result, nvl_node, run

pytestmark = pytest.mark.django_db


def test_nvlink_joined(now):
    nvl_node("tray-1", now)
    # A lone HGX: a completed fabric with a cluster UUID of zeros is no domain, not a fault.
    zeros = {**JOINED, "cluster_uuid": "00000000-0000-0000-0000-000000000000"}
    make_node("hgx", now=now, gpus=[gpu_payload(i, fabric=zeros) for i in range(8)])
    make_node("pcie", now=now, gpus=2)
    assert_result(run(doctor.check_nvlink_joined, now), Result.PASS, [])
    nvl_node("tray-2", now, g2={"state": "In Progress", "status": "N/A", "cluster_uuid": ""})
    assert_result(
        run(doctor.check_nvlink_joined, now),
        Result.FAIL,
        ["tray-2"],
        ["tray-2: GPU 2 not joined (In Progress, N/A)"],
    )


def test_nvlink_bandwidth(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_bandwidth, now), Result.PASS, [])
    nvl_node("tray-2", now, g1={"bandwidth": "Degraded"})
    assert_result(
        run(doctor.check_nvlink_bandwidth, now),
        Result.WARN,
        ["tray-2"],
        ["tray-2: GPU 1 NVLink bandwidth Degraded"],
    )


def test_nvlink_health_unhealthy_card_keeps_the_node_out(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_health, now), Result.PASS, [])
    # The recorded GB200 card: joined (Completed, Success), full bandwidth, Summary Unhealthy.
    node = nvl_node("tray-2", now, g2={"health": "Unhealthy"})
    assert node.nvlink_domain == ""
    assert_result(
        run(doctor.check_nvlink_health, now),
        Result.FAIL,
        ["tray-2"],
        ["tray-2: GPU 2 NVLink fabric health Unhealthy: the node is kept out of multi-node NVLink placement"],
    )
    nvl_node("tray-3", now, g0={"health": "Healthy"})
    assert Node.objects.get(id="tray-3").nvlink_domain == f"{CLUSTER}/7"


def test_nvlink_domains(now):
    nvl_node("tray-1", now)
    assert_result(run(doctor.check_nvlink_domains, now), Result.PASS, [])
    nvl_node("tray-2", now, g3={"clique_id": "8"})
    assert_result(
        run(doctor.check_nvlink_domains, now),
        Result.FAIL,
        ["tray-2"],
        [f"tray-2: cards in 2 domains: {CLUSTER}/7, {CLUSTER}/8"],
    )


def test_imex(now):
    nvl_node("tray-1", now)
    # Not in a domain: IMEX does not matter.
    make_node("pcie", now=now, gpus=2)
    assert_result(run(doctor.check_imex, now), Result.PASS, [])
    nvl_node("tray-2", now, imex={"state": "DOWN", "channels": 1})
    nvl_node("tray-3", now, imex={"state": "UP", "channels": 0})
    assert_result(
        run(doctor.check_imex, now),
        Result.FAIL,
        ["tray-2", "tray-3"],
        ["tray-2: IMEX DOWN", "tray-3: IMEX up without a channel"],
    )
