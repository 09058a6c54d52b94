"""Placement in the admin: pages, actions and the planner's reason node by node."""

from __future__ import annotations

import pytest
from django.test import Client

from inventory.nodes import change_state
from placement.models import Deployment, EngineProfile, PlacementEvent, PowerBudget, Replica
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db

PAGES = ["engineprofile", "deployment", "replica", "shard", "placementevent", "hold", "powerbudget"]


@pytest.fixture
def setup(now):
    make_node("a", now=now, gpus=2, labels={"rack": "r1"})
    make_node("b", now=now)
    change_state("b", "cordoned", now=now)
    prof = EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4)
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=1)
    PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=40_000)
    reconcile(now=now)
    return dep


def login(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


@pytest.mark.parametrize("model", PAGES)
def test_operator_sees_every_page(model, operator, setup):
    assert login(operator).get(f"/admin/placement/{model}/").status_code == 200


def test_not_staff_is_sent_to_login(viewer):
    r = login(viewer).get("/admin/placement/deployment/")
    assert r.status_code == 302 and "/admin/login/" in r["Location"]


def test_pending_replica_shows_reasons_node_by_node(operator, setup):
    rep = Replica.objects.get()
    c = login(operator)
    page = c.get(f"/admin/placement/replica/{rep.pk}/change/").content.decode()
    assert "<tr><td>a</td><td>2 free GPUs, needs 4</td></tr>" in page
    assert "<tr><td>b</td><td>cordoned</td></tr>" in page
    why = c.get(f"/admin/placement/replica/{rep.pk}/why/").content.decode()
    assert "Nowhere now: 2 free GPUs, needs 4 (a); cordoned (b)" in why


def test_pause_action_needs_change_permission(operator, viewer, setup):
    dep = setup
    viewer.is_staff = True
    viewer.save()
    data = {"action": "pause", "_selected_action": [dep.pk]}
    login(viewer).post("/admin/placement/deployment/", data)
    assert Deployment.objects.get().paused is False
    r = login(operator).post("/admin/placement/deployment/", data)
    assert r.status_code == 302
    assert Deployment.objects.get().paused is True
    ev = PlacementEvent.objects.get(kind="paused")
    assert ev.actor_name == "operator"
