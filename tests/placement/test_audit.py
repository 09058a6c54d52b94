"""Every operator change to a profile, a hold or a power budget is recorded with who and
when, through the API and the admin alike; a refused change records nothing."""

from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from placement.models import Deployment, EngineProfile, Hold, PlacementEvent, PowerBudget, Shard
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def api(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def admin(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


def only_event(user, kind: str) -> str:
    """The one event written, checked for who and when; its reason."""
    ev = PlacementEvent.objects.get()
    assert (ev.kind, ev.actor, ev.actor_name, ev.deployment, ev.replica) == (kind, user, user.username, None, None)
    assert ev.at is not None
    ev.delete()
    return ev.reason


PROFILE_FORM = {
    "name": "vllm-8",
    "engine": "vllm",
    "engine_version": "",
    "gpu_class": "",
    "tp": "4",
    "pp": "1",
    "gpus_per_node": "4",
    "nodes": "1",
    "memory_gb": "0",
    "cpu_cores": "0",
    "power_w": "0",
    "args": "[]",
    "env": "{}",
    "model_path": "",
    "disk_gb": "0",
    "served_model_name": "",
    "startup_timeout_s": "1800",
}


def test_profile_through_the_api(operator):
    c = api(operator)
    r = c.post("/api/v1/profiles/", {"name": "vllm-8", "engine": "vllm", "tp": 4}, format="json")
    assert r.status_code == 201, r.json()
    assert only_event(operator, "profile") == "created: profile vllm-8"
    pk = r.json()["id"]
    r = c.patch(f"/api/v1/profiles/{pk}/", {"tp": 8, "args": ["--x"]}, format="json")
    assert r.status_code == 200, r.json()
    assert only_event(operator, "profile") == "changed: profile vllm-8: tp 4 -> 8, args [] -> ['--x']"
    assert c.patch(f"/api/v1/profiles/{pk}/", {"tp": 8}, format="json").status_code == 200
    assert not PlacementEvent.objects.exists()  # nothing changed
    assert c.delete(f"/api/v1/profiles/{pk}/").status_code == 204
    assert only_event(operator, "profile") == "deleted: profile vllm-8"


def test_profile_through_the_admin(operator):
    c = admin(operator)
    r = c.post("/admin/placement/engineprofile/add/", PROFILE_FORM)
    assert r.status_code == 302
    assert only_event(operator, "profile") == "created: profile vllm-8"
    prof = EngineProfile.objects.get()
    # tp x pp must be every GPU a vLLM replica holds: the form names the field, nothing is written.
    r = c.post(f"/admin/placement/engineprofile/{prof.pk}/change/", {**PROFILE_FORM, "tp": "8"})
    assert r.status_code == 200
    assert "runs tp x pp = 8 x 1 = 8 ranks, one per GPU, but nodes x gpus_per_node = 1 x 4 = 4" in r.content.decode()
    assert EngineProfile.objects.get().tp == 4
    r = c.post(f"/admin/placement/engineprofile/{prof.pk}/change/", {**PROFILE_FORM, "tp": "8", "gpus_per_node": "8"})
    assert r.status_code == 302
    assert only_event(operator, "profile") == "changed: profile vllm-8: tp 4 -> 8, gpus_per_node 4 -> 8"
    r = c.post(f"/admin/placement/engineprofile/{prof.pk}/delete/", {"post": "yes"})
    assert r.status_code == 302 and not EngineProfile.objects.exists()
    assert only_event(operator, "profile") == "deleted: profile vllm-8"


def test_hold_through_the_api(operator):
    c = api(operator)
    body = {"scope": "label", "label_key": "rack", "label_value": "r12", "reason": "maintenance"}
    r = c.post("/api/v1/holds/", body, format="json")
    assert r.status_code == 201, r.json()
    assert Hold.objects.get().created_by == operator
    assert only_event(operator, "hold") == "created: hold rack=r12 (maintenance)"
    assert c.delete(f"/api/v1/holds/{r.json()['id']}/").status_code == 204
    assert only_event(operator, "hold") == "deleted: hold rack=r12 (maintenance)"


def test_hold_through_the_admin(operator, now):
    make_node("a", now=now)
    c = admin(operator)
    form = {"scope": "node", "node": "a", "label_key": "", "label_value": "", "fabric": "", "reason": ""}
    assert c.post("/admin/placement/hold/add/", form).status_code == 302
    hold = Hold.objects.get()
    assert hold.created_by == operator
    assert only_event(operator, "hold") == "created: hold node a"
    r = c.post(f"/admin/placement/hold/{hold.pk}/change/", {**form, "reason": "bad DIMM"})
    assert r.status_code == 302
    assert only_event(operator, "hold") == "changed: hold node a: reason '' -> 'bad DIMM'"
    assert Hold.objects.get().created_by == operator  # a change keeps who created it
    assert c.post(f"/admin/placement/hold/{hold.pk}/delete/", {"post": "yes"}).status_code == 302
    assert only_event(operator, "hold") == "deleted: hold node a (bad DIMM)"


def test_power_budget_through_the_api(operator):
    c = api(operator)
    r = c.post("/api/v1/power-budgets/", {"label_key": "rack", "label_value": "r12", "budget_w": 40000}, format="json")
    assert r.status_code == 201, r.json()
    assert only_event(operator, "power_budget") == "created: power budget rack=r12 (40000 W)"
    pk = r.json()["id"]
    assert c.patch(f"/api/v1/power-budgets/{pk}/", {"budget_w": 32500.5}, format="json").status_code == 200
    assert only_event(operator, "power_budget") == "changed: power budget rack=r12: budget_w 40000.0 -> 32500.5"
    assert c.delete(f"/api/v1/power-budgets/{pk}/").status_code == 204
    assert only_event(operator, "power_budget") == "deleted: power budget rack=r12 (32500.5 W)"


def test_power_budget_through_the_admin(operator):
    c = admin(operator)
    form = {"label_key": "rack", "label_value": "r12", "budget_w": "40000"}
    assert c.post("/admin/placement/powerbudget/add/", form).status_code == 302
    assert only_event(operator, "power_budget") == "created: power budget rack=r12 (40000 W)"
    pk = PowerBudget.objects.get().pk
    r = c.post(f"/admin/placement/powerbudget/{pk}/change/", {**form, "label_value": "r13"})
    assert r.status_code == 302
    assert only_event(operator, "power_budget") == "changed: power budget rack=r12: label_value 'r12' -> 'r13'"
    assert c.post(f"/admin/placement/powerbudget/{pk}/delete/", {"post": "yes"}).status_code == 302
    assert only_event(operator, "power_budget") == "deleted: power budget rack=r13 (40000 W)"


def test_admin_bulk_delete_records_each(operator):
    a = PowerBudget.objects.create(label_key="rack", label_value="r1", budget_w=1000)
    b = PowerBudget.objects.create(label_key="rack", label_value="r2", budget_w=2000)
    data = {"action": "delete_selected", "_selected_action": [a.pk, b.pk], "post": "yes"}
    assert admin(operator).post("/admin/placement/powerbudget/", data).status_code == 302
    assert not PowerBudget.objects.exists()
    assert sorted(PlacementEvent.objects.values_list("kind", "actor_name", "reason")) == [
        ("power_budget", "operator", "deleted: power budget rack=r1 (1000 W)"),
        ("power_budget", "operator", "deleted: power budget rack=r2 (2000 W)"),
    ]


def test_refused_changes_record_nothing(operator):
    prof = EngineProfile.objects.create(name="vllm-8", engine="vllm", tp=4)
    budget = PowerBudget.objects.create(label_key="rack", label_value="r12", budget_w=40000)
    c = api(operator)
    assert c.patch(f"/api/v1/profiles/{prof.pk}/", {"tp": 0}, format="json").status_code == 400
    assert c.post("/api/v1/holds/", {"scope": "fabric"}, format="json").status_code == 400
    assert c.patch(f"/api/v1/power-budgets/{budget.pk}/", {"budget_w": -1}, format="json").status_code == 400
    r = admin(operator).post(f"/admin/placement/engineprofile/{prof.pk}/change/", {**PROFILE_FORM, "tp": "0"})
    assert r.status_code == 200  # the form again, with its error
    assert EngineProfile.objects.get().tp == 4
    assert not PlacementEvent.objects.exists()


def test_a_profile_in_use_is_not_deleted_nor_recorded(operator):
    prof = EngineProfile.objects.create(name="vllm-8", engine="vllm")
    Deployment.objects.create(name="chat", served_model="chat", profile=prof)
    r = admin(operator).post(f"/admin/placement/engineprofile/{prof.pk}/delete/", {"post": "yes"})
    assert r.status_code == 200  # the admin names the deployment that protects it
    assert EngineProfile.objects.exists()
    assert not PlacementEvent.objects.exists()


def test_events_without_a_deployment_are_listed(operator, viewer):
    api(operator).post(
        "/api/v1/power-budgets/", {"label_key": "rack", "label_value": "r12", "budget_w": 1}, format="json"
    )
    r = api(viewer).get("/api/v1/placement-events/", {"kind": "power_budget"})
    assert [(e["deployment"], e["actor_name"], e["reason"]) for e in r.json()["results"]] == [
        (None, "operator", "created: power budget rack=r12 (1 W)")
    ]
    page = admin(operator).get("/admin/placement/placementevent/").content.decode()
    assert "created: power budget rack=r12 (1 W)" in page


def test_a_profile_in_use_is_refused_through_the_api(operator):
    prof = EngineProfile.objects.create(name="vllm-8", engine="vllm")
    Deployment.objects.create(name="chat", served_model="chat", profile=prof)
    r = api(operator).delete(f"/api/v1/profiles/{prof.pk}/")
    assert r.status_code == 409
    assert r.json() == {"deployments": ["still used by chat: delete them or move them to another profile first"]}
    assert EngineProfile.objects.exists()
    assert not PlacementEvent.objects.exists()


def _stopped_deployment(now) -> tuple[Deployment, set[int]]:
    """A deployment whose one replica ran and stopped: events about it and its replica exist."""
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    dep = Deployment.objects.create(name="chat", served_model="chat-m", profile=profile, replicas=1)
    make_node("a", now=now)
    reconcile(now=now)
    Deployment.objects.filter(id=dep.id).update(replicas=0)
    reconcile(now=now)
    Shard.objects.update(state="stopped")
    reconcile(now=now)
    history = set(PlacementEvent.objects.values_list("id", flat=True))
    assert PlacementEvent.objects.filter(replica__deployment=dep).exists()
    return dep, history


def test_deleting_a_deployment_through_the_api_keeps_its_history_and_records_who(operator, now):
    dep, history = _stopped_deployment(now)
    assert api(operator).delete(f"/api/v1/deployments/{dep.id}/").status_code == 204
    assert not Deployment.objects.exists()
    kept = PlacementEvent.objects.filter(id__in=history)
    assert kept.count() == len(history)
    assert set(kept.values_list("deployment_name", flat=True)) == {"chat"}
    gone = PlacementEvent.objects.exclude(id__in=history).get()
    assert (gone.kind, gone.actor, gone.actor_name, gone.deployment_name) == ("deleted", operator, "operator", "chat")
    assert gone.reason == "deleted: deployment chat (model chat-m, profile echo-1)"
    listed = api(operator).get("/api/v1/placement-events/?kind=deleted").json()["results"]
    assert [(e["deployment"], e["deployment_name"], e["actor_name"]) for e in listed] == [(None, "chat", "operator")]


def test_deleting_a_deployment_in_the_admin_records_who(operator, now):
    dep, history = _stopped_deployment(now)
    resp = admin(operator).post(f"/admin/placement/deployment/{dep.id}/delete/", {"post": "yes"})
    assert resp.status_code == 302
    assert not Deployment.objects.exists()
    gone = PlacementEvent.objects.exclude(id__in=history).get()
    assert (gone.kind, gone.actor, gone.deployment_name) == ("deleted", operator, "chat")
    assert PlacementEvent.objects.filter(id__in=history).count() == len(history)
