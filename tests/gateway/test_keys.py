"""API keys: the secret returned once, only its hash stored, changes recorded and pushed."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import redis
from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from gateway import keys, notify
from gateway.models import ApiKey, KeyEvent
from tests.gateway.conftest import make_deployment, url_of, wait_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def subscriber():
    """A Redis subscriber on the gateway's channel, as a data plane listens."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub()
    pubsub.subscribe(notify.channel())
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    yield pubsub
    pubsub.close()
    client.close()


def _next(pubsub) -> dict | None:
    m = pubsub.get_message(timeout=2)
    return json.loads(m["data"]) if m else None


def test_create_returns_the_secret_once_and_stores_only_its_hash(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    key, secret = keys.create_key(name="ci", owner=owner, now=now, allowed_models=["b", "a", "a"], rpm_limit=5)
    key.refresh_from_db()
    assert secret.startswith("llmgw-sk-") and len(secret) > 40
    assert key.key_hash == keys.hash_secret(secret)
    assert secret not in {str(getattr(key, f.attname)) for f in ApiKey._meta.concrete_fields}
    assert key.prefix == secret[:15]
    assert key.allowed_models == ["a", "b"]
    assert (key.rpm_limit, key.tpm_limit, key.created_at) == (5, 0, now)
    ev = KeyEvent.objects.get(key=key)
    assert (ev.kind, ev.detail, ev.actor_name) == ("created", "owner bob", "system")


def test_revoke_is_a_compare_and_set_with_an_event(django_user_model, now, operator):
    key, _ = keys.create_key(name="ci", owner=operator, now=now)
    assert keys.revoke(key.id, now=now, actor=operator) is True
    assert keys.revoke(key.id, now=now, actor=operator) is False
    key.refresh_from_db()
    assert key.revoked_at == now
    assert not key.usable(now)
    assert list(KeyEvent.objects.filter(key=key).values_list("kind", "actor_name")) == [
        ("revoked", "operator"),
        ("created", "system"),
    ]


def test_usable_follows_expiry(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    key, _ = keys.create_key(name="ci", owner=owner, now=now, expires_at=now + dt.timedelta(hours=1))
    assert key.usable(now + dt.timedelta(minutes=59))
    assert not key.usable(now + dt.timedelta(hours=1))


def test_expiry_before_creation_is_refused_by_the_database(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    with pytest.raises(IntegrityError, match="gateway_apikey_expires_after_created"):
        keys.create_key(name="ci", owner=owner, now=now, expires_at=now - dt.timedelta(seconds=1))


@pytest.mark.django_db(transaction=True)
def test_changes_are_pushed_to_the_data_planes(django_user_model, now, subscriber):
    owner = django_user_model.objects.create_user("bob")
    key, _ = keys.create_key(name="ci", owner=owner, now=now)
    assert _next(subscriber) == {"kind": "keys"}
    keys.update(key.id, {"rpm_limit": 5}, now=now, actor=None)
    assert _next(subscriber) == {"kind": "keys"}
    keys.update(key.id, {"rpm_limit": 5}, now=now, actor=None)  # no change: nothing pushed
    keys.rotate(key.id, now=now)
    assert _next(subscriber) == {"kind": "keys"}
    keys.revoke(key.id, now=now)
    assert _next(subscriber) == {"kind": "keys"}
    assert _next(subscriber) is None


def test_update_records_each_change_old_to_new_and_nothing_for_no_change(django_user_model, now, operator):
    owner = django_user_model.objects.create_user("bob")
    key, _ = keys.create_key(name="ci", owner=owner, now=now, allowed_models=["a"])
    later = now + dt.timedelta(hours=1)
    expires = now + dt.timedelta(days=1)
    keys.update(
        key.id,
        {"name": "ci2", "allowed_models": ["c", "b"], "tokens_per_month": 10, "expires_at": expires, "tpm_limit": 0},
        now=later,
        actor=operator,
    )
    key.refresh_from_db()
    assert (key.name, key.allowed_models, key.tokens_per_month, key.expires_at) == ("ci2", ["b", "c"], 10, expires)
    ev = KeyEvent.objects.filter(key=key).first()
    assert (ev.at, ev.kind, ev.actor_name) == (later, "changed", "operator")
    assert ev.detail == (
        "name: 'ci' -> 'ci2'; allowed_models: [a] -> [b, c]; tokens_per_month: 0 -> 10;"
        " expires_at: None -> 2026-12-01T12:00:00+00:00"
    )
    keys.update(key.id, {"name": "ci2"}, now=later, actor=operator)
    assert KeyEvent.objects.filter(key=key).count() == 2
    with pytest.raises(ValueError, match="not changeable: key_hash, prefix"):
        keys.update(key.id, {"key_hash": "0" * 64, "prefix": "x"}, now=later, actor=operator)


def test_rotate_keeps_the_record_and_replaces_the_hash(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    key, old = keys.create_key(name="ci", owner=owner, now=now, tokens_per_day=5)
    same, new = keys.rotate(key.id, now=now, actor_name="someone")
    key.refresh_from_db()
    assert same.id == key.id and key.tokens_per_day == 5
    assert key.key_hash == keys.hash_secret(new) and new != old
    assert not ApiKey.objects.filter(key_hash=keys.hash_secret(old)).exists()
    ev = KeyEvent.objects.filter(key=key).first()
    assert (ev.kind, ev.actor_name) == ("rotated", "someone")
    assert ev.detail == f"secret {old[:15]}… replaced by {new[:15]}…"
    keys.revoke(key.id, now=now)
    with pytest.raises(keys.KeyRefused, match="the key 'ci' is revoked"):
        keys.rotate(key.id, now=now)


def test_budgets_are_checked_by_the_database(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    with pytest.raises(IntegrityError, match="gateway_apikey_day_budget_within_month"):
        keys.create_key(name="ci", owner=owner, now=now, tokens_per_day=11, tokens_per_month=10)


def test_a_day_budget_alone_or_within_the_month_is_accepted(django_user_model, now):
    owner = django_user_model.objects.create_user("bob")
    keys.create_key(name="day", owner=owner, now=now, tokens_per_day=11)
    keys.create_key(name="month", owner=owner, now=now, tokens_per_month=10)
    keys.create_key(name="both", owner=owner, now=now, tokens_per_day=10, tokens_per_month=10)
    assert ApiKey.objects.count() == 3


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_rotated_key_opens_the_gateway_with_its_new_secret_only(gateway, echoes, user):
    make_deployment("demo", [url_of(echoes())])
    key, old = keys.create_key(name="rotating", owner=user, now=timezone.now())
    gateway.wait_ready(old, "demo", 1)
    _, new = keys.rotate(key.id, now=timezone.now(), actor=user)

    def answers(secret: str) -> int:
        with gateway.client(secret) as c:
            return c.post("/v1/completions", json={"model": "demo", "prompt": "a"}).status_code

    wait_for(lambda: answers(old) == 401, timeout=5, what="the old secret refused")
    assert answers(new) == 200
