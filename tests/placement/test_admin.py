"""Placement in the admin: pages, actions and the planner's reason node by node."""

from __future__ import annotations

import re
import uuid

import pytest
from django.test import Client
from django.utils import timezone

import llmgw_wire as wire
from inventory.models import Allocation, Command, Node
from inventory.nodes import change_state
from placement import agent_sync, snapshot_db
from placement.models import Deployment, EngineProfile, PlacementEvent, PowerBudget, Replica, Shard
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
    # "Ask the planner" plans now: the nodes were heard from just now.
    Node.objects.update(last_seen=timezone.now())
    rep = Replica.objects.get()
    c = login(operator)
    page = c.get(f"/admin/placement/replica/{rep.pk}/change/").content.decode()
    assert "<tr><td>a</td><td>2 free GPUs, needs 4</td></tr>" in page
    assert "<tr><td>b</td><td>cordoned</td></tr>" in page
    why = c.get(f"/admin/placement/replica/{rep.pk}/why/").content.decode()
    assert "Nowhere now: 2 free GPUs, needs 4 (a); cordoned (b)" in why
    # Summarised: each reason with its node count and names; every node's reason is a link away.
    assert "<tr><td>2 free GPUs, needs 4</td><td>1</td><td>a</td></tr>" in why
    assert "<tr><td>cordoned</td><td>1</td><td>b</td></tr>" in why
    assert '<a href="?explain=all">' in why and "<tr><td>b</td><td>cordoned</td></tr>" not in why
    every = c.get(f"/admin/placement/replica/{rep.pk}/why/?explain=all").content.decode()
    assert "<tr><td>a</td><td>2 free GPUs, needs 4</td></tr>" in every
    assert "<tr><td>b</td><td>cordoned</td></tr>" in every


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


def test_power_budgets_show_what_is_claimed_under_each(operator, now):
    make_node("a", now=now, labels={"rack": "r1", "topology.llmgw.io/pdu": "p1"})
    make_node("b", now=now, labels={"rack": "r1"})
    make_node("c", now=now, labels={"rack": "r2", "topology.llmgw.io/pdu": "p1"})
    make_node("d", now=now)
    for node_id, watts in [("a", 2800.0), ("a", 700.5), ("b", 1400.0), ("c", 350.0), ("d", 5000.0)]:
        Allocation.objects.create(node_id=node_id, replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), power_w=watts)
    PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=40_000)
    PowerBudget.objects.create(label_key="rack", label_value="r2", budget_w=0)
    PowerBudget.objects.create(label_key="rack", label_value="r3", budget_w=1_000)
    PowerBudget.objects.create(label_key="topology.llmgw.io/pdu", label_value="p1", budget_w=3_000)
    page = login(operator).get("/admin/placement/powerbudget/").content.decode()
    cells = re.findall(r'<td class="field-claimed">([^<]*)</td>', page)
    # Ordered by key then value: rack=r1, r2, r3, then the PDU.
    assert cells == ["4,900 (12%)", "350", "0 (0%)", "3,850 (128%)"]
    # The planner's own count.
    assert snapshot_db.build().budget_used == {
        ("rack", "r1"): 4900.5,
        ("rack", "r2"): 350.0,
        ("topology.llmgw.io/pdu", "p1"): 3850.5,
    }


@pytest.fixture
def placed(now):
    make_node("a", now=now, gpus=4)
    prof = EngineProfile.objects.create(name="echo-2", engine="echo", gpus_per_node=2)
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=1)
    reconcile(now=now)
    return dep


def test_replica_shard_and_allocation_pages_are_views_with_the_actions_that_make_sense(operator, placed):
    rep = Replica.objects.get()
    shard = rep.shards.get()
    alloc = Allocation.objects.get()
    c = login(operator)
    page = c.get(f"/admin/placement/replica/{rep.pk}/change/").content.decode()
    assert "<h1>View replica</h1>" in page
    assert 'name="_save"' not in page and "/delete/" not in page
    assert f'href="/admin/placement/replica/{rep.pk}/why/" id="ask-planner">Ask the planner</a>' in page
    assert f'href="/admin/placement/replica/{rep.pk}/retire/" id="retire-replica">Retire…</a>' in page
    for url, title in (
        (f"/admin/placement/shard/{shard.pk}/change/", "View shard"),
        (f"/admin/inventory/allocation/{alloc.pk}/change/", "View allocation"),
    ):
        body = c.get(url).content.decode()
        assert f"<h1>{title}</h1>" in body
        assert 'name="_save"' not in body and "/delete/" not in body
    # Nothing is deleted through them either.
    assert c.post(f"/admin/placement/replica/{rep.pk}/delete/", {"post": "yes"}).status_code == 403
    assert c.post(f"/admin/inventory/allocation/{alloc.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Replica.objects.filter(pk=rep.pk).exists() and Allocation.objects.filter(pk=alloc.pk).exists()


def test_retire_asks_first_then_stops_the_replica_and_records_who(operator, viewer, placed):
    viewer.is_staff = True
    viewer.save()
    rep = Replica.objects.get()
    c = login(operator)
    confirm = c.get(f"/admin/placement/replica/{rep.pk}/retire/").content.decode()
    assert "so the reconciler places a new one if this leaves it short" in confirm
    assert Replica.objects.get(pk=rep.pk).state == rep.state
    # A viewer cannot.
    assert login(viewer).post(f"/admin/placement/replica/{rep.pk}/retire/", {}).status_code == 403
    r = c.post(f"/admin/placement/replica/{rep.pk}/retire/", {"reason": "bad weights"})
    assert r.status_code == 302 and r["Location"] == f"/admin/placement/replica/{rep.pk}/change/"
    rep.refresh_from_db()
    # Its shard still runs (nothing reported it stopped): it drains, keeping its GPUs.
    assert (rep.state, rep.reason) == ("draining", "retired by operator: bad weights")
    ev = PlacementEvent.objects.filter(replica=rep).latest("id")
    assert ev.actor_name == "operator"
    assert Command.objects.filter(kind="stop_shard", node_id="a").count() == 1
    # Retiring it again is refused, saying why.
    r = c.post(f"/admin/placement/replica/{rep.pk}/retire/", {}, follow=True)
    assert [str(m) for m in r.context["messages"]][-1] == f"not retired: {rep} is draining"


def test_a_failed_shard_shows_its_cause_and_its_engines_output_preformatted(operator, placed, now):
    shard = Shard.objects.get()
    tail = [
        "INFO serving with --api-key s3cret",
        "WARNING <unknown> config key",
        "OSError: [Errno 98] Address already in use",
    ]
    failed = wire.ShardStatus(
        shard_id=str(shard.id), state="failed", reason="the engine exited with code 1", exit_code=1, log_tail=tail
    )
    agent_sync.record_shard_states("a", [failed], now=now)
    # As written, line for line, escaped; the secret masked.
    pre = (
        '<pre class="engine-output" style="white-space: pre-wrap; font-family: monospace; max-height: 32em; '
        'overflow: auto; margin: 0">INFO serving with --api-key ***\nWARNING &lt;unknown&gt; config key\n'
        "OSError: [Errno 98] Address already in use</pre>"
    )
    cause = "the engine exited with code 1: OSError: [Errno 98] Address already in use"
    c = login(operator)
    page = c.get(f"/admin/placement/shard/{shard.pk}/change/").content.decode()
    assert f'<div class="readonly">{pre}</div>' in page
    assert f'<div class="readonly">{cause}</div>' in page
    assert "s3cret" not in page
    # In its replica's table of shards: folded.
    page = c.get(f"/admin/placement/replica/{shard.replica_id}/change/").content.decode()
    assert f"<details><summary>3 lines</summary>{pre}</details>" in page
    assert cause in page


def test_a_deployment_no_node_fits_is_deleted_from_the_admin(operator, now):
    """Its only replica stayed pending, holding nothing: the admin deletes it at once, and records who."""
    prof = EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4)
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=1)
    reconcile(now=now)  # no node: pending
    assert list(Replica.objects.values_list("state", flat=True)) == ["pending"]
    c = login(operator)
    assert c.get(f"/admin/placement/deployment/{dep.pk}/delete/").status_code == 200
    r = c.post(f"/admin/placement/deployment/{dep.pk}/delete/", {"post": "yes"})
    assert r.status_code == 302 and not Deployment.objects.exists() and not Replica.objects.exists()
    gone = PlacementEvent.objects.get(kind="deleted")
    assert (gone.actor, gone.deployment_name) == (operator, "chat")
