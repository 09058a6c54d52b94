"""One validation for every door: the admin, the API and the database refuse the same poison.

Args that are not an argv list of strings, an env that is not a map of
strings, a power that is not a finite number of watts, a replica count in
the billions: each a clear error naming the field at the admin and the API,
an IntegrityError naming its constraint at the database, and rows written
before the constraints are mended by their migration.
"""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.db import IntegrityError, connection, transaction
from django.test import Client
from rest_framework.test import APIClient

from placement import bounds
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica
from placement.reconciler import BATCH_PER_PASS, reconcile
from tests.factories import make_node
from tests.placement.test_audit import PROFILE_FORM

pytestmark = pytest.mark.django_db

POISON = [
    ("args", "[1, null]", "item 0 is a number: every argument is a string"),
    ("args", '{"a": "b"}', "must be a list of strings (an argv list), not an object"),
    ("env", '["A"]', "must be an object of names to strings, not a list"),
    ("env", '{"A": 1}', "A is a number: every value is a string"),
    ("power_w", "nan", None),
    ("power_w", "inf", None),
    ("power_w", "2e6", "must be between 0 and 1e+06 W"),
]


def admin(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


def api(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


@pytest.mark.parametrize(("field", "value", "message"), POISON)
def test_the_admin_refuses_poison_on_add_and_change_pages(operator, field, value, message):
    c = admin(operator)
    r = c.post("/admin/placement/engineprofile/add/", {**PROFILE_FORM, field: value})
    assert r.status_code == 200
    errors = r.context["adminform"].form.errors
    assert list(errors) == [field]
    if message:
        assert message in errors[field]
    assert not EngineProfile.objects.exists()
    prof = EngineProfile.objects.create(name="vllm-8", engine="vllm", tp=4, gpus_per_node=4)
    r = c.post(f"/admin/placement/engineprofile/{prof.pk}/change/", {**PROFILE_FORM, field: value})
    assert r.status_code == 200 and list(r.context["adminform"].form.errors) == [field]
    prof.refresh_from_db()
    assert (prof.args, prof.env, prof.power_w) == ([], {}, 0.0)
    assert not PlacementEvent.objects.exists()


def test_the_admin_refuses_a_replica_count_the_api_refuses(operator, viewer):
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    form = {"name": "big", "served_model": "big", "profile": prof.pk, "pool": "", "node_selector": "{}"}
    form |= {"policy": "binpack"}
    r = admin(operator).post("/admin/placement/deployment/add/", {**form, "replicas": "2147483647"})
    assert r.status_code == 200
    assert r.context["adminform"].form.errors["replicas"] == ["Ensure this value is less than or equal to 10000."]
    body = {"name": "big", "served_model": "big", "profile": prof.pk, "replicas": 2147483647}
    r = api(operator).post("/api/v1/deployments/", body, format="json")
    assert r.status_code == 400 and list(r.json()) == ["replicas"]
    assert not Deployment.objects.exists()
    # The auth matrix is unchanged by the bounds: anonymous and viewers are refused before any of them.
    assert APIClient().post("/api/v1/deployments/", body, format="json").status_code in (401, 403)
    assert api(viewer).post("/api/v1/deployments/", body, format="json").status_code == 403


API_POISON = [("args", "[1, null]"), ("args", '"x"'), ("env", '["A"]'), ("env", '{"A": 1}')]
API_POISON += [("power_w", '"Infinity"'), ("power_w", "2e6"), ("power_w", "NaN")]


@pytest.mark.parametrize(("field", "value"), API_POISON)
def test_the_api_refuses_the_same_poison_naming_the_field(operator, field, value):
    body = f'{{"name": "vllm-8", "engine": "vllm", "tp": 4, "{field}": {value}}}'
    r = api(operator).post("/api/v1/profiles/", body, content_type="application/json")
    assert r.status_code == 400
    if value == "NaN":
        # Not JSON at all: the parser refuses the literal before any field is read.
        assert r.json()["detail"].startswith("JSON parse error")
    else:
        assert list(r.json()) == [field]
    assert not EngineProfile.objects.exists()


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        ({"args": [1, None]}, "placement_profile_args_strings"),
        ({"args": {"a": "b"}}, "placement_profile_args_strings"),
        ({"env": ["A"]}, "placement_profile_env_strings"),
        ({"env": {"A": None}}, "placement_profile_env_strings"),
        ({"power_w": float("nan")}, "placement_profile_power_bounded"),
        ({"power_w": float("inf")}, "placement_profile_power_bounded"),
        ({"power_w": -1.0}, "placement_profile_power_bounded"),
    ],
)
def test_the_database_refuses_poison_by_a_named_constraint(fields, constraint):
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        EngineProfile.objects.create(name="p", engine="vllm", **fields)


def test_the_database_refuses_a_replica_count_past_the_bound():
    prof = EngineProfile.objects.create(name="p", engine="echo")
    with pytest.raises(IntegrityError, match="placement_deployment_replicas_bounded"), transaction.atomic():
        Deployment.objects.create(name="d", served_model="d", profile=prof, replicas=bounds.MAX_REPLICAS + 1)


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        ({"autoscale_min": bounds.MAX_REPLICAS + 1}, "placement_deployment_autoscale_min_bounded"),
        ({"autoscale_max": bounds.MAX_REPLICAS + 1}, "placement_deployment_autoscale_max_bounded"),
        # Off or on, the stored bounds stay within the replica bound.
        (
            {"autoscale_metric": "inflight", "autoscale_target": 1.0, "autoscale_min": 1, "autoscale_max": 10_001},
            "placement_deployment_autoscale_max_bounded",
        ),
        (
            {"autoscale_metric": "inflight", "autoscale_target": 1.0, "autoscale_min": 5, "autoscale_max": 4},
            "placement_deployment_autoscale_bounds",
        ),
    ],
)
def test_the_database_refuses_autoscaling_bounds_past_the_replica_bound_or_inverted(fields, constraint):
    prof = EngineProfile.objects.create(name="p", engine="echo")
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        Deployment.objects.create(name="d", served_model="d", profile=prof, **fields)


def test_the_database_refuses_a_negative_autoscaling_bound_by_name():
    # The ORM's PositiveIntegerField is not the guard: a raw update past it meets the named constraint.
    prof = EngineProfile.objects.create(name="p", engine="echo")
    d = Deployment.objects.create(name="d", served_model="d", profile=prof)
    for column in ("autoscale_min", "autoscale_max"):
        with (
            pytest.raises(IntegrityError, match=f"placement_deployment_{column}_bounded|{column}"),
            transaction.atomic(),
        ):
            Deployment.objects.filter(pk=d.pk).update(**{column: -1})


def test_autoscaling_bounds_past_the_replica_bound_are_mended_by_their_migration():
    if connection.vendor != "postgresql":
        pytest.skip("the constraints are dropped for the test by PostgreSQL's transactional DDL")
    table = Deployment._meta.db_table
    _drop((table, "placement_deployment_autoscale_min_bounded"), (table, "placement_deployment_autoscale_max_bounded"))
    prof = EngineProfile.objects.create(name="p", engine="echo")
    on = Deployment.objects.create(name="on", served_model="on", profile=prof, autoscale_metric="inflight",
                                   autoscale_target=1.0, autoscale_min=20_000, autoscale_max=2_000_000)  # fmt: skip
    off = Deployment.objects.create(name="off", served_model="off", profile=prof, autoscale_min=3, autoscale_max=99_999)
    importlib.import_module("placement.migrations.0012_autoscale_bounds_constraints").mend(apps, None)
    on.refresh_from_db()
    off.refresh_from_db()
    assert (on.autoscale_min, on.autoscale_max) == (bounds.MAX_REPLICAS, bounds.MAX_REPLICAS)
    assert (off.autoscale_min, off.autoscale_max) == (3, bounds.MAX_REPLICAS)
    # What the migration leaves, the constraints take (the rows' deferred foreign-key checks first).
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cur.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT placement_deployment_autoscale_min_bounded "
            "CHECK (autoscale_min >= 0 AND autoscale_min <= 10000)"
        )
        cur.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT placement_deployment_autoscale_max_bounded "
            "CHECK (autoscale_max >= 0 AND autoscale_max <= 10000)"
        )


def _drop(*constraints: str) -> None:
    # Inside the test's transaction (PostgreSQL's DDL is transactional): rolled back after the test.
    with connection.cursor() as cur:
        for table, name in constraints:
            cur.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")


def test_rows_written_before_the_constraints_show_and_are_mended_by_the_migration(operator):
    """As an install upgraded from before the bounds holds them: pages answer, then the migration mends them."""
    if connection.vendor != "postgresql":
        pytest.skip("the constraints are dropped for the test by PostgreSQL's transactional DDL")
    prof_table, dep_table = EngineProfile._meta.db_table, Deployment._meta.db_table
    _drop(
        (prof_table, "placement_profile_args_strings"),
        (prof_table, "placement_profile_env_strings"),
        (prof_table, "placement_profile_power_bounded"),
        (dep_table, "placement_deployment_replicas_bounded"),
    )
    bad = EngineProfile.objects.create(
        name="bad", engine="vllm", args=["--x", 1, None, {"k": 2}], env={"A": 1, "B": None, "C": "c"}
    )
    EngineProfile.objects.filter(pk=bad.pk).update(power_w=float("nan"))
    listy = EngineProfile.objects.create(name="listy", engine="vllm", args="--x", env=["A"], power_w=float("inf"))
    Deployment.objects.create(name="d", served_model="d", profile=bad, replicas=2_147_483_647)
    c = admin(operator)
    assert c.get("/admin/placement/engineprofile/").status_code == 200
    for p in (bad, listy):
        assert c.get(f"/admin/placement/engineprofile/{p.pk}/change/").status_code == 200

    importlib.import_module("placement.migrations.0011_bounds").mend(apps, None)
    bad.refresh_from_db()
    listy.refresh_from_db()
    assert (bad.args, bad.env, bad.power_w) == (["--x", "1", '{"k": 2}'], {"A": "1", "C": "c"}, 0.0)
    assert (listy.args, listy.env, listy.power_w) == ([], {}, 0.0)
    assert Deployment.objects.get().replicas == bounds.MAX_REPLICAS
    assert api(operator).get("/api/v1/profiles/").status_code == 200


def test_a_huge_replica_count_is_created_in_batches_and_keeps_no_other_deployment_waiting(now):
    for n in ("a", "b"):
        make_node(n, now=now)
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    big = Deployment.objects.create(name="big", served_model="big", profile=prof, replicas=bounds.MAX_REPLICAS)
    small = Deployment.objects.create(name="small", served_model="small", profile=prof, replicas=1)
    report = reconcile(now=now)
    assert report.created == BATCH_PER_PASS + 1
    assert Replica.objects.filter(deployment=big).count() == BATCH_PER_PASS
    # Sixteen cards: the small deployment's one replica is placed in the same pass, beside fifteen of the big one.
    assert Replica.objects.filter(deployment=small, state="starting").count() == 1
    assert Replica.objects.filter(deployment=big, state="starting").count() == 15
