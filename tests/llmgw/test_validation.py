"""The one validation layer: unstorable strings, deep JSON, page bounds, over the operator API."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from llmgw import validation
from placement.models import EngineProfile
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def client(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_json_depth_counts_nesting_outside_strings():
    assert validation.json_depth(b'{"a": [1, {"b": 2}]}') == 3
    assert validation.json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert validation.json_depth(b'{"a": "\\"[[["}') == 1
    assert validation.json_depth(b"[" * 50_000 + b"]" * 50_000) == 50_000


def test_unstorable_fields_name_each_path():
    found = list(validation.unstorable_fields({"a": ["ok", "x\x00"], "b": {"c\x00": "v"}, "d": "\ud800"}))
    assert found == [
        ("a.1", "Null characters are not allowed."),
        ("b", "a key: Null characters are not allowed."),
        ("d", "Surrogate characters are not allowed."),
    ]


def test_nul_problems_only_walks_bodies_with_the_escape():
    assert validation.nul_problems(b'{"hostname": "h"}') == []
    assert validation.nul_problems(b'{"gpus": [{"name": "A\\u0000"}]}') == [
        {"field": "gpus.0.name", "problem": "Null characters are not allowed."}
    ]


def test_label_body_nested_50000_deep_is_400(operator, now):
    make_node("node-a", now=now)
    body = '{"labels": ' + "[" * 50_000 + "]" * 50_000 + "}"
    r = client(operator).generic("PUT", "/api/v1/nodes/node-a/labels/", body, content_type="application/json")
    assert r.status_code == 400
    assert r.json() == {"detail": "JSON parse error - nested deeper than 32 levels"}


def test_nul_in_a_profile_env_is_400_naming_the_field(operator):
    body = {"name": "p", "engine": "echo", "env": {"HF_HOME": "/x\x00"}}
    r = client(operator).post("/api/v1/profiles/", body, format="json")
    assert r.status_code == 400
    assert r.json() == {"env.HF_HOME": ["Null characters are not allowed."]}
    assert not EngineProfile.objects.exists()


def test_nul_in_a_label_value_is_400(operator, now):
    make_node("node-a", now=now)
    r = client(operator).put("/api/v1/nodes/node-a/labels/", {"labels": {"rack": "r\x00"}}, format="json")
    assert r.status_code == 400
    assert r.json() == {"labels.rack": ["Null characters are not allowed."]}


@pytest.mark.parametrize("query", ["limit=99999999999999999999", "offset=99999999999999999999"])
def test_huge_limit_or_offset_is_bounded(operator, query):
    for i in range(3):
        EngineProfile.objects.create(name=f"p{i}", engine="echo")
    r = client(operator).get(f"/api/v1/profiles/?{query}")
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == 3
    assert len(body["results"]) == (3 if query.startswith("limit") else 0)


def test_limit_is_capped_at_max_page(operator):
    EngineProfile.objects.bulk_create(EngineProfile(name=f"p{i:04}", engine="echo") for i in range(1001))
    r = client(operator).get("/api/v1/profiles/?limit=5000")
    assert len(r.json()["results"]) == validation.MAX_PAGE


def test_only_json_bodies_are_parsed(operator):
    r = client(operator).post(
        "/api/v1/profiles/", "name=p&engine=echo", content_type="application/x-www-form-urlencoded"
    )
    assert r.status_code == 415
    assert json.loads(r.content)["detail"].startswith("Unsupported media type")


def test_nul_in_an_id_is_404_and_in_a_filter_400(operator):
    c = client(operator)
    assert c.get("/api/v1/nodes/a%00b/").status_code == 404
    r = c.get("/api/v1/profiles/?name=x%00")
    assert r.status_code == 400
    assert r.json() == {"name": ["Null characters are not allowed."]}
    r = c.get("/api/v1/nodes/?search=%ED%A0%80")
    # Bytes that are not UTF-8 arrive replaced (U+FFFD), which PostgreSQL stores: an ordinary search.
    assert r.status_code == 200


def test_nul_in_an_admin_url_is_404(client, admin_user):
    client.force_login(admin_user)
    assert client.get("/admin/inventory/node/a%00b/change/").status_code == 404
