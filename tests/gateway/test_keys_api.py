"""The keys' REST API (/api/v1/gateway/keys/): auth matrix, the secret once, changes recorded, rotate and revoke."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gateway import keys, usage
from gateway.models import ApiKey, KeyEvent
from tests.test_api_document import _check, doc  # noqa: F401  (the document, as /api/schema/ serves it)

pytestmark = pytest.mark.django_db

KEYS = "/api/v1/gateway/keys/"


def client(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


@pytest.fixture
def key(operator, now):
    k, _ = keys.create_key(name="team-a", owner=operator, now=now, rpm_limit=10)
    return k


def test_anonymous_is_refused_everything(key):
    c = client()
    assert c.get(KEYS).status_code == 401
    assert c.get(f"{KEYS}{key.id}/").status_code == 401
    assert c.post(KEYS, {"name": "x", "owner": "operator"}, format="json").status_code == 401
    assert c.patch(f"{KEYS}{key.id}/", {"rpm_limit": 1}, format="json").status_code == 401
    assert c.post(f"{KEYS}{key.id}/rotate/").status_code == 401
    assert c.post(f"{KEYS}{key.id}/revoke/").status_code == 401
    assert ApiKey.objects.get().revoked_at is None


def test_viewer_reads_and_changes_nothing(viewer, key):
    c = client(viewer)
    r = c.get(KEYS)
    assert r.status_code == 200
    assert [k["name"] for k in r.json()["results"]] == ["team-a"]
    assert c.get(f"{KEYS}{key.id}/").json()["prefix"] == key.prefix
    assert c.post(KEYS, {"name": "x", "owner": "viewer"}, format="json").status_code == 403
    assert c.patch(f"{KEYS}{key.id}/", {"rpm_limit": 1}, format="json").status_code == 403
    assert c.post(f"{KEYS}{key.id}/rotate/").status_code == 403
    assert c.post(f"{KEYS}{key.id}/revoke/").status_code == 403
    assert c.delete(f"{KEYS}{key.id}/").status_code in (403, 405)
    key.refresh_from_db()
    assert (key.rpm_limit, key.revoked_at, ApiKey.objects.count()) == (10, None, 1)
    assert list(KeyEvent.objects.values_list("kind", flat=True)) == ["created"]


def test_an_agent_credential_is_not_an_operator(client, settings, key):
    """A node's credential talks to the agent endpoints only: the keys are refused to it."""
    from tests.agents.conftest import JOIN, post
    from tests.factories import register_payload

    settings.LLMGW_JOIN_TOKEN = JOIN
    cred = post(client, "register", register_payload("node-a"), JOIN).json()["credential"]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {cred}"}
    assert client.get(KEYS, **auth).status_code in (401, 403)
    assert client.post(f"{KEYS}{key.id}/revoke/", **auth).status_code in (401, 403)


def test_operator_creates_a_key_and_sees_its_secret_once(operator, django_user_model, doc):  # noqa: F811
    django_user_model.objects.create_user("alice")
    expires = timezone.now() + dt.timedelta(days=30)
    body = {
        "name": "ci",
        "owner": "alice",
        "allowed_models": ["b", "a", "a"],
        "rpm_limit": 60,
        "tpm_limit": 1000,
        "tokens_per_day": 5000,
        "tokens_per_month": 100000,
        "expires_at": expires.isoformat(),
    }
    r = client(operator).post(KEYS, body, format="json")
    assert r.status_code == 201, r.content
    _check(doc, "post", KEYS, r)
    got = r.json()
    secret = got.pop("secret")
    key = ApiKey.objects.get(name="ci")
    assert key.key_hash == keys.hash_secret(secret)
    assert got == {
        "id": key.id,
        "name": "ci",
        "prefix": secret[:15],
        "owner": "alice",
        "allowed_models": ["a", "b"],
        "rpm_limit": 60,
        "tpm_limit": 1000,
        "tokens_per_day": 5000,
        "tokens_per_month": 100000,
        "spent_today": 0,
        "spent_this_month": 0,
        "expires_at": expires.astimezone(dt.UTC).isoformat().replace("+00:00", "Z"),
        "revoked_at": None,
        "created_at": got["created_at"],
        "created_by": "operator",
    }
    # Never again: neither a read nor a list holds it.
    assert secret not in client(operator).get(f"{KEYS}{key.id}/").content.decode()
    assert secret not in client(operator).get(KEYS).content.decode()
    ev = KeyEvent.objects.get(key=key)
    assert (ev.kind, ev.detail, ev.actor, ev.actor_name) == ("created", "owner alice", operator, "operator")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"owner": "operator"}, "name"),
        ({"name": "x"}, "owner"),
        ({"name": "x", "owner": "nobody"}, "owner"),
        ({"name": "x", "owner": "operator", "rpm_limit": -1}, "rpm_limit"),
        ({"name": "x", "owner": "operator", "tpm_limit": 2**31}, "tpm_limit"),
        ({"name": "x", "owner": "operator", "tokens_per_month": 2**63}, "tokens_per_month"),
        ({"name": "x", "owner": "operator", "tokens_per_day": 11, "tokens_per_month": 10}, "tokens_per_day"),
        ({"name": "x", "owner": "operator", "expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "x", "owner": "operator", "allowed_models": "demo"}, "allowed_models"),
        ({"name": "x" * 129, "owner": "operator"}, "name"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(operator, body, field, doc):  # noqa: F811
    r = client(operator).post(KEYS, body, format="json")
    assert r.status_code == 400
    assert list(r.json()) == [field]
    _check(doc, "post", KEYS, r)
    assert not ApiKey.objects.exists()


def test_operator_changes_limits_recorded_old_to_new(operator, key, doc, django_user_model):  # noqa: F811
    c = client(operator)
    r = c.patch(
        f"{KEYS}{key.id}/",
        {"rpm_limit": 20, "tokens_per_day": 500, "allowed_models": ["demo"], "name": "team-a"},
        format="json",
    )
    assert r.status_code == 200, r.content
    _check(doc, "patch", f"{KEYS}{{id}}/", r)
    assert (r.json()["rpm_limit"], r.json()["tokens_per_day"], r.json()["allowed_models"]) == (20, 500, ["demo"])
    key.refresh_from_db()
    assert (key.rpm_limit, key.tokens_per_day, key.allowed_models) == (20, 500, ["demo"])
    ev = KeyEvent.objects.filter(key=key).first()
    assert (ev.kind, ev.actor_name) == ("changed", "operator")
    assert ev.detail == "allowed_models: [] -> [demo]; rpm_limit: 10 -> 20; tokens_per_day: 0 -> 500"
    # The month's budget may not fall below the day's the key already has.
    r = c.patch(f"{KEYS}{key.id}/", {"tokens_per_month": 100}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["tokens_per_day"]
    # A change to nothing records nothing.
    assert c.patch(f"{KEYS}{key.id}/", {"rpm_limit": 20}, format="json").status_code == 200
    assert KeyEvent.objects.filter(key=key).count() == 2
    assert c.put(f"{KEYS}{key.id}/", {"rpm_limit": 1}, format="json").status_code == 405
    django_user_model.objects.create_user("bob")
    r = c.patch(f"{KEYS}{key.id}/", {"owner": "bob"}, format="json")
    assert r.status_code == 200 and r.json()["owner"] == "bob"
    assert KeyEvent.objects.filter(key=key).first().detail == "owner: operator -> bob"
    r = c.patch(f"{KEYS}{key.id}/", {"owner": "ghost"}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["owner"]


def test_rotate_gives_the_same_key_a_new_secret(operator, key, doc):  # noqa: F811
    old_hash = key.key_hash
    r = client(operator).post(f"{KEYS}{key.id}/rotate/")
    assert r.status_code == 200
    _check(doc, "post", f"{KEYS}{{id}}/rotate/", r)
    secret = r.json()["secret"]
    key.refresh_from_db()
    assert r.json()["id"] == key.id and r.json()["rpm_limit"] == 10
    assert key.key_hash == keys.hash_secret(secret) != old_hash
    assert key.prefix == secret[:15] == r.json()["prefix"]
    ev = KeyEvent.objects.filter(key=key).first()
    assert (ev.kind, ev.actor_name) == ("rotated", "operator")
    assert ApiKey.objects.count() == 1


def test_revoke_then_neither_revoke_nor_rotate_again(operator, key, doc):  # noqa: F811
    c = client(operator)
    r = c.post(f"{KEYS}{key.id}/revoke/")
    assert r.status_code == 200
    _check(doc, "post", f"{KEYS}{{id}}/revoke/", r)
    assert r.json()["revoked_at"] is not None
    again = c.post(f"{KEYS}{key.id}/revoke/")
    assert again.status_code == 409
    _check(doc, "post", f"{KEYS}{{id}}/revoke/", again)
    assert again.json() == {"detail": "the key 'team-a' is already revoked"}
    rot = c.post(f"{KEYS}{key.id}/rotate/")
    assert rot.status_code == 409
    _check(doc, "post", f"{KEYS}{{id}}/rotate/", rot)
    assert rot.json() == {"detail": "the key 'team-a' is revoked; create a new key instead"}
    assert list(KeyEvent.objects.filter(key=key).values_list("kind", "actor_name")) == [
        ("revoked", "operator"),
        ("created", "system"),
    ]


def test_list_shows_this_day_and_month_spend(viewer, key, operator):
    now = timezone.now()
    other, _ = keys.create_key(name="other", owner=operator, now=now)
    acc = usage.Accumulator()
    acc.add(key.id, "demo", now.timestamp(), prompt_tokens=3, completion_tokens=4)
    acc.add(other.id, "demo", now.timestamp(), prompt_tokens=1)
    usage.write_batch(acc.take())
    rows = {k["name"]: (k["spent_today"], k["spent_this_month"]) for k in client(viewer).get(KEYS).json()["results"]}
    assert rows == {"team-a": (7, 7), "other": (1, 1)}
    assert client(viewer).get(f"{KEYS}{key.id}/").json()["spent_today"] == 7


def test_list_query_count_does_not_grow(viewer, operator, now, django_assert_num_queries):
    c = client(viewer)
    keys.create_key(name="k0", owner=operator, now=now)
    c.get(KEYS)  # the user's permissions, read once and cached
    # The count, the page (with owners), the page's spend.
    with django_assert_num_queries(3):
        assert c.get(KEYS).json()["count"] == 1
    for i in range(1, 6):
        keys.create_key(name=f"k{i}", owner=operator, now=now)
    with django_assert_num_queries(3):
        assert c.get(KEYS).json()["count"] == 6


def test_a_user_in_neither_role_is_refused(django_user_model, key):
    nobody = django_user_model.objects.create_user("nobody")
    c = client(nobody)
    assert c.get(KEYS).status_code == 403
    assert c.get(f"{KEYS}{key.id}/").status_code == 403
    assert c.post(f"{KEYS}{key.id}/revoke/").status_code == 403
    assert c.get("/api/v1/gateway/usage/").status_code == 403
