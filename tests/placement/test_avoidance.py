"""A node a deployment keeps off after failed starts: shown with its cause and expiry, cleared by an operator."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

import llmgw_wire as wire
from placement import agent_sync, backoff
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db

WHY = "the engine exited with code 1"


@pytest.fixture
def dep():
    prof = EngineProfile.objects.create(name="echo-8", engine="echo", gpus_per_node=8)
    return Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=1)


def fail_starts(dep: Deployment, node_id: str, times: list[dt.datetime], *, port_in_use: bool = False) -> None:
    """Place a replica on the node at each time and have its agent report the shard failed."""
    for t in times:
        make_node(node_id, now=t)
        Replica.objects.filter(deployment=dep, state="pending").update(not_before=None)
        reconcile(now=t)
        shard = Shard.objects.get(replica__deployment=dep, state="pending", node_id=node_id)
        status = wire.ShardStatus(
            shard_id=str(shard.id),
            state="failed",
            reason=f"port {shard.http_port} is already in use on this node" if port_in_use else WHY,
            exit_code=None if port_in_use else 1,
            port_in_use=shard.http_port if port_in_use else None,
        )
        agent_sync.record_shard_states(node_id, [status], now=t)
        reconcile(now=t)


def test_avoidance_has_its_cause_and_its_expiry(dep, settings):
    t0 = timezone.now() - dt.timedelta(minutes=10)
    fail_starts(dep, "a", [t0, t0 + dt.timedelta(minutes=1)])
    window = dt.timedelta(seconds=settings.LLMGW_START_FAILURE_WINDOW)
    (a,) = backoff.avoidances(dep, now=timezone.now())
    assert (a.node_id, a.failures, a.last_at) == ("a", 2, t0 + dt.timedelta(minutes=1))
    assert a.last_reason == f"shard 0 on a failed: {WHY}"
    assert a.why == "avoided: 2 failed starts here in the last 30 min"
    # LLMGW_AVOID_AFTER (2) failures keep it: it ends when the older of the two ages out of the window.
    assert a.until == t0 + window
    assert backoff.avoidances(dep, now=a.until + dt.timedelta(seconds=1)) == []
    # With one failure enough, it lasts until the newest ages out.
    settings.LLMGW_AVOID_AFTER = 1
    assert backoff.avoidances(dep, now=timezone.now())[0].until == t0 + dt.timedelta(minutes=1) + window


def test_a_port_found_taken_is_no_failure_of_the_deployment(dep):
    t0 = timezone.now() - dt.timedelta(minutes=5)
    fail_starts(dep, "a", [t0, t0 + dt.timedelta(seconds=5), t0 + dt.timedelta(seconds=10)], port_in_use=True)
    assert backoff.start_failures({dep.id}, now=timezone.now()) == {}
    assert backoff.avoidances(dep, now=timezone.now()) == []
    # Each was placed again at once, on the next port.
    assert Replica.objects.filter(deployment=dep, state="failed").count() == 3
    (again,) = Replica.objects.filter(deployment=dep, state="starting")
    assert again.not_before is None


def api(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


def test_the_api_shows_it_and_an_operator_clears_it_on_the_record(dep, viewer, operator):
    t0 = timezone.now() - dt.timedelta(minutes=3)
    fail_starts(dep, "a", [t0, t0 + dt.timedelta(minutes=1)])
    url = f"/api/v1/deployments/{dep.id}/"
    assert api().get(url + "avoidance/").status_code == 401
    shown = api(viewer).get(url + "avoidance/")
    assert shown.status_code == 200
    (row,) = shown.json()
    assert (row["node"], row["failures"], row["last_reason"]) == ("a", 2, f"shard 0 on a failed: {WHY}")
    assert row["until"] == (t0 + dt.timedelta(minutes=30)).isoformat().replace("+00:00", "Z")
    # Only an operator clears it, naming a node that exists.
    assert api().post(url + "clear-avoidance/", {"node": "a"}, format="json").status_code == 401
    assert api(viewer).post(url + "clear-avoidance/", {"node": "a"}, format="json").status_code == 403
    bad = api(operator).post(url + "clear-avoidance/", {"node": "nope"}, format="json")
    assert bad.status_code == 400 and list(bad.json()) == ["node"]
    assert not PlacementEvent.objects.filter(kind="avoidance_cleared").exists()
    r = api(operator).post(url + "clear-avoidance/", {"node": "a"}, format="json")
    assert r.status_code == 200
    assert (r.json()["cleared"]["node"], r.json()["avoided"]) == ("a", [])
    ev = PlacementEvent.objects.get(kind="avoidance_cleared")
    assert (ev.deployment_id, ev.actor, ev.actor_name) == (dep.id, operator, "operator")
    assert ev.reason == f"avoidance of node a cleared (2 failed starts there, last: shard 0 on a failed: {WHY})"
    # The failures there no longer count: no avoidance, no backoff.
    assert backoff.start_failures({dep.id}, now=timezone.now()) == {}
    # A failure after the clear counts again.
    fail_starts(dep, "a", [timezone.now()])
    assert backoff.start_failures({dep.id}, now=timezone.now())[dep.id].count == 1


def test_the_admin_shows_it_and_its_action_clears_it(dep, viewer, operator):
    t0 = timezone.now() - dt.timedelta(minutes=3)
    fail_starts(dep, "a", [t0, t0 + dt.timedelta(minutes=1)])
    c = Client()
    c.force_login(operator)
    page = c.get(f"/admin/placement/deployment/{dep.pk}/change/").content.decode()
    until = (t0 + dt.timedelta(minutes=30)).strftime("%Y-%m-%d %H:%M:%S")
    assert "<li><b>a</b>: 2 failed starts, last" in page
    assert f"(until {until} UTC;" in page
    viewer.is_staff = True
    viewer.save()
    v = Client()
    v.force_login(viewer)
    v.post("/admin/placement/deployment/", {"action": "clear_avoidance", "_selected_action": [dep.pk]})
    assert len(backoff.avoidances(dep, now=timezone.now())) == 1
    r = c.post("/admin/placement/deployment/", {"action": "clear_avoidance", "_selected_action": [dep.pk]}, follow=True)
    assert [str(m) for m in r.context["messages"]] == ["1 node avoidances cleared"]
    assert backoff.avoidances(dep, now=timezone.now()) == []
    assert PlacementEvent.objects.get(kind="avoidance_cleared").actor == operator
    page = c.get(f"/admin/placement/deployment/{dep.pk}/change/").content.decode()
    assert re.search(r"Avoided nodes:</label>\s*<div class=\"readonly\">none</div>", page)
