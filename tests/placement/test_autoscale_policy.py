"""The autoscaling policy: named constraints, the API (400 naming the field, auth), the admin, the record."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone
from django.utils.html import escape
from rest_framework.test import APIClient

from placement import autoscale_chart
from placement.models import AutoscaleSample, Deployment, EngineProfile, PlacementEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def dep():
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    return Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=1)


def api(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


POLICY = {
    "autoscale_metric": "ttft_p95",
    "autoscale_min": 0,
    "autoscale_max": 4,
    "autoscale_target": 1.0,
    "scale_up_window_s": 30,
    "scale_down_window_s": 600,
}


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"autoscale_min": 3, "autoscale_max": 2}, "placement_deployment_autoscale_bounds"),
        ({"autoscale_min": 0, "autoscale_max": 0}, "placement_deployment_autoscale_bounds"),
        ({"autoscale_target": 0.0}, "placement_deployment_autoscale_target_positive"),
        ({"autoscale_metric": "gpu"}, "placement_deployment_autoscale_metric_valid"),
    ],
)
def test_the_database_refuses_a_policy_that_cannot_hold(dep, fields, name):
    good = {"autoscale_metric": "inflight", "autoscale_min": 1, "autoscale_max": 2, "autoscale_target": 4.0}
    with pytest.raises(IntegrityError, match=name), transaction.atomic():
        Deployment.objects.filter(id=dep.id).update(**{**good, **fields})


def test_off_constrains_nothing(dep):
    Deployment.objects.filter(id=dep.id).update(autoscale_metric="", autoscale_min=5, autoscale_max=0)


def test_operator_sets_the_policy_and_it_is_recorded(dep, operator):
    r = api(operator).post(f"/api/v1/deployments/{dep.id}/autoscale/", POLICY, format="json")
    assert r.status_code == 200
    assert {k: r.json()[k] for k in POLICY} == POLICY
    ev = PlacementEvent.objects.get(kind="autoscale_policy")
    assert ev.actor == operator and ev.deployment_id == dep.id
    assert ev.reason == (
        "autoscale_metric '' -> 'ttft_p95', autoscale_min 1 -> 0, autoscale_max 1 -> 4, "
        "autoscale_target 0.0 -> 1.0, scale_up_window_s 0 -> 30, scale_down_window_s 300 -> 600"
    )
    # The same again changes nothing and records nothing; a partial write keeps the rest.
    api(operator).post(f"/api/v1/deployments/{dep.id}/autoscale/", POLICY, format="json")
    assert PlacementEvent.objects.filter(kind="autoscale_policy").count() == 1
    r = api(operator).post(f"/api/v1/deployments/{dep.id}/autoscale/", {"autoscale_max": 6}, format="json")
    assert r.json()["autoscale_max"] == 6 and r.json()["autoscale_metric"] == "ttft_p95"
    assert PlacementEvent.objects.filter(kind="autoscale_policy").first().reason == "autoscale_max 4 -> 6"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**POLICY, "autoscale_min": 5}, "autoscale_max"),
        ({**POLICY, "autoscale_max": 0}, "autoscale_max"),
        ({**POLICY, "autoscale_target": 0}, "autoscale_target"),
        ({**POLICY, "autoscale_target": -1}, "autoscale_target"),
        ({**POLICY, "autoscale_metric": "gpu"}, "autoscale_metric"),
        ({**POLICY, "autoscale_min": -1}, "autoscale_min"),
        ({**POLICY, "scale_down_window_s": 86_401}, "scale_down_window_s"),
        ({**POLICY, "scale_up_window_s": "soon"}, "scale_up_window_s"),
        ({"autoscale_metric": "inflight"}, "autoscale_target"),  # the stored target is 0
    ],
)
def test_a_bad_policy_is_a_400_naming_the_field_and_changes_nothing(dep, operator, body, field):
    r = api(operator).post(f"/api/v1/deployments/{dep.id}/autoscale/", body, format="json")
    assert r.status_code == 400
    assert list(r.json()) == [field]
    dep.refresh_from_db()
    assert dep.autoscale_metric == "" and not PlacementEvent.objects.exists()


def test_the_deployment_write_checks_the_policy_too(dep, operator):
    r = api(operator).patch(
        f"/api/v1/deployments/{dep.id}/", {"autoscale_metric": "queue", "autoscale_target": 0}, format="json"
    )
    assert r.status_code == 400 and list(r.json()) == ["autoscale_target"]
    r = api(operator).patch(
        f"/api/v1/deployments/{dep.id}/", {"autoscale_metric": "queue", "autoscale_target": 2}, format="json"
    )
    assert r.status_code == 200
    ev = PlacementEvent.objects.get(kind="changed")
    assert ev.reason == "saved through the API: autoscale_metric '' -> 'queue', autoscale_target 0.0 -> 2.0"


def test_auth_matrix(dep, viewer):
    url = f"/api/v1/deployments/{dep.id}/autoscale/"
    assert api().post(url, POLICY, format="json").status_code in (401, 403)
    assert api(viewer).post(url, POLICY, format="json").status_code == 403
    assert api().get(f"/api/v1/deployments/{dep.id}/autoscale-samples/").status_code in (401, 403)
    assert api(viewer).get(f"/api/v1/deployments/{dep.id}/autoscale-samples/").status_code == 200


def test_samples_are_listed_oldest_first(dep, viewer, now):
    for i, n in enumerate([1, 2, 3]):
        AutoscaleSample.objects.create(
            deployment=dep, at=now.replace(second=i), replicas=n, desired=n, recommended=n, signal=0.5 * n
        )
    rows = api(viewer).get(f"/api/v1/deployments/{dep.id}/autoscale-samples/").json()["results"]
    assert [(r["replicas"], r["signal"]) for r in rows] == [(1, 0.5), (2, 1.0), (3, 1.5)]


def _admin_form(dep: Deployment, **changes) -> dict:
    form = {
        "name": dep.name,
        "served_model": dep.served_model,
        "profile": dep.profile_id,
        "replicas": dep.replicas,
        "pool": "",
        "node_selector": "{}",
        "policy": dep.policy,
        "autoscale_metric": "",
        "autoscale_min": 1,
        "autoscale_max": 1,
        "autoscale_target": 0,
        "scale_up_window_s": 0,
        "scale_down_window_s": 300,
        "replica_set-TOTAL_FORMS": 0,
        "replica_set-INITIAL_FORMS": 0,
    }
    return {**form, **changes}


def test_admin_refuses_a_bad_policy_by_field_and_records_a_good_one(dep, operator):
    c = Client()
    c.force_login(operator)
    url = f"/admin/placement/deployment/{dep.pk}/change/"
    page = c.get(url).content.decode()
    assert "Autoscaling" in page and 'name="autoscale_metric"' in page
    r = c.post(url, _admin_form(dep, autoscale_metric="inflight", autoscale_min=3, autoscale_max=2, autoscale_target=4))
    assert r.status_code == 200
    assert r.context["adminform"].form.errors == {"autoscale_max": ["must not be below the minimum (3)"]}
    r = c.post(url, _admin_form(dep, autoscale_metric="inflight", autoscale_min=0, autoscale_max=2, autoscale_target=4))
    assert r.status_code == 302
    dep.refresh_from_db()
    assert (dep.autoscale_metric, dep.autoscale_min, dep.autoscale_max) == ("inflight", 0, 2)
    ev = PlacementEvent.objects.get(kind="changed")
    assert ev.actor == operator
    assert ev.reason == (
        "saved in the admin: autoscale_metric '' -> 'inflight', autoscale_min 1 -> 0, "
        "autoscale_max 1 -> 2, autoscale_target 0.0 -> 4.0"
    )


def test_the_chart_steps_the_replicas_and_draws_the_measured_signal(now):
    start = now - dt.timedelta(hours=1)
    rows = [
        (now - dt.timedelta(minutes=30), 1, 0.5),
        (now - dt.timedelta(minutes=20), 1, None),
        (now - dt.timedelta(minutes=15), 2, 1.0),
    ]
    c = autoscale_chart.chart(rows, start=start, end=now)
    assert c.replicas.points == "300.0,60.0 400.0,60.0 400.0,60.0 450.0,60.0 450.0,0.0 600,0.0"
    assert c.signal.points == "300.0,60.0 450.0,0.0"
    assert (c.replicas.peak, c.replicas.last, c.signal.peak, c.signal.last, c.samples) == (2.0, 2.0, 1.0, 1.0, 3)
    empty = autoscale_chart.chart([], start=start, end=now)
    assert (empty.replicas.points, empty.signal.points, empty.signal.last) == ("", "", None)


def test_the_deployment_page_shows_the_chart_and_the_recent_steps(dep, operator):
    Deployment.objects.filter(id=dep.id).update(**{k: v for k, v in POLICY.items()})
    now = timezone.now()
    for i, n in enumerate([1, 2]):
        AutoscaleSample.objects.create(
            deployment=dep, at=now - dt.timedelta(minutes=10 - i), replicas=n, desired=n, recommended=n, signal=1.5
        )
    reason = "TTFT p95 1.5 s > 1.0 s for 30 s: 1 -> 2 replicas"
    PlacementEvent.objects.create(at=now, deployment=dep, kind="autoscaled", reason=reason)
    c = Client()
    c.force_login(operator)
    page = c.get(f"/admin/placement/deployment/{dep.pk}/change/").content.decode()
    assert 'id="autoscale-chart"' in page and 'id="autoscale-replicas"' in page
    assert f"<td>{escape(reason)}</td>" in page
    assert "2 passes" in page
