"""The doctor all together: a healthy cluster, the command and the API."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inventory import doctor, fabric, scans
from inventory.doctor import Result
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.doctor.helpers import IB0, nvl_node
from tests.inventory.ibports import ib_port, put
from tests.inventory.test_scans import recorded

pytestmark = pytest.mark.django_db


def healthy_cluster(now):
    nvl_node("tray-1", now, fabrics=IB0)
    # Two adapter ports of the recorded QDR map, and that map as the fabric's last scan.
    put(
        "tray-1",
        now=now,
        ports=[ib_port("mlx5_0", port_guid="78e7:d103:0022:97fd"), ib_port("mlx5_1", port_guid="0x003048c749cd0001")],
    )
    [order] = scans.schedule_fabric_scans(now=now)
    fabric.set_scan(
        key=order.key,
        at=now,
        node_id="tray-1",
        port="mlx5_0/1",
        output=recorded("x5-qdr-2020.topo"),
        error="",
        took_s=2,
    )


def test_run_on_a_healthy_cluster_passes_every_check(now):
    healthy_cluster(now)
    results = doctor.run(now=now)
    assert [r.name for r in results] == list(doctor.check_names())
    assert {r.result for r in results} == {Result.PASS}
    assert doctor.overall(results) == Result.PASS


def test_command_exit_status_and_json(now):
    healthy_cluster(now)
    import io

    out = io.StringIO()
    call_command("doctor", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["result"] == "pass"
    assert [c["name"] for c in report["checks"]] == list(doctor.check_names())
    change_state("tray-1", "unreachable", now=now)
    change_state("tray-1", "lost", now=now)
    out = io.StringIO()
    with pytest.raises(CommandError) as exc:
        call_command("doctor", stdout=out)
    assert exc.value.returncode == 1
    assert str(exc.value) == "failed: nodes_reachable"
    assert "FAIL nodes_reachable: 1 node(s) not heartbeating" in out.getvalue()
    assert "ok   clock_skew: every agent's clock is within 2 s" in out.getvalue()


def test_api_auth_matrix(client, viewer, operator, django_user_model):
    url = "/api/v1/doctor"
    assert client.get(url).status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Bearer some-node-credential").status_code == 401
    nobody = django_user_model.objects.create_user("nobody", password="pw-nobody-1")
    client.force_login(nobody)
    assert client.get(url).status_code == 403
    for user in (viewer, operator):
        client.force_login(user)
        resp = client.get(url)
        assert resp.status_code == 200
        body = resp.json()
        assert body["result"] == "pass"
        assert [c["name"] for c in body["checks"]] == list(doctor.check_names())
    assert client.post(url).status_code == 405


def test_api_reports_failures(client, viewer, now):
    make_node("a", now=now, gpus=0)
    change_state("a", "unreachable", now=now)
    client.force_login(viewer)
    body = client.get("/api/v1/doctor").json()
    assert body["result"] == "warn"
    check = next(c for c in body["checks"] if c["name"] == "nodes_reachable")
    assert check == {
        "name": "nodes_reachable",
        "result": "warn",
        "summary": "1 node(s) not heartbeating",
        "action": check["action"],
        "nodes": ["a"],
        "details": ["a: no heartbeat since 2026-11-30 12:00:00"],
    }
