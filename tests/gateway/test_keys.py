"""API keys: the secret returned once, only its hash stored, changes recorded and pushed."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import redis
from django.conf import settings
from django.db import IntegrityError

from gateway import keys, notify
from gateway.models import ApiKey, KeyEvent

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
    keys.changed(key, ["rpm_limit"], now=now, actor=None)
    assert _next(subscriber) == {"kind": "keys"}
    keys.changed(key, [], now=now, actor=None)
    keys.revoke(key.id, now=now)
    assert _next(subscriber) == {"kind": "keys"}
    assert _next(subscriber) is None
