"""API keys: create (the secret returned once), change, rotate, revoke; each recorded and pushed to the data planes.

Rotating gives the same key record a new secret: its limits, budgets, usage
history and events stay with it (a successor record would start its budgets
again, so rotating would be a way round them). The old secret stops opening
the gateway as soon as the data planes hear of it (a push, within a second).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from django.db import transaction

from gateway import notify
from gateway.models import ApiKey, KeyEvent

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

KEY_PREFIX = "llmgw-sk-"
# The fields an operator may change after creation (the secret changes only by rotating).
CHANGEABLE = (
    "name",
    "owner",
    "allowed_models",
    "rpm_limit",
    "tpm_limit",
    "tokens_per_day",
    "tokens_per_month",
    "expires_at",
)


class KeyRefused(Exception):
    """An action the key's state does not allow (rotating a revoked key); the message says why."""


def hash_secret(secret: str) -> str:
    """The stored (and in-memory) form of a key's secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    """A fresh 256-bit secret, prefixed so a leaked one is recognisable in logs and scanners."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _record(
    key: ApiKey,
    kind: str,
    detail: str,
    *,
    now: dt.datetime,
    actor: AbstractBaseUser | None,
    actor_name: str | None = None,
) -> None:
    if actor_name is None:
        actor_name = actor.get_username() if actor is not None else "system"
    KeyEvent.objects.create(at=now, key=key, kind=kind, detail=detail, actor=actor, actor_name=actor_name[:150])


def create_key(
    *,
    name: str,
    owner: AbstractBaseUser,
    now: dt.datetime,
    allowed_models: Iterable[str] = (),
    rpm_limit: int = 0,
    tpm_limit: int = 0,
    tokens_per_day: int = 0,
    tokens_per_month: int = 0,
    expires_at: dt.datetime | None = None,
    actor: AbstractBaseUser | None = None,
    actor_name: str | None = None,
    key: ApiKey | None = None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its secret, which is not kept anywhere: show it once.

    `key`, when given, is an unsaved instance to fill (the admin's form).
    `actor_name` names who acted when no user did (default: the actor's
    username, or "system"), as every function here takes it.
    """
    secret = new_secret()
    key = key or ApiKey()
    key.name, key.owner = name, owner
    key.allowed_models = sorted(set(allowed_models))
    key.rpm_limit, key.tpm_limit, key.expires_at = rpm_limit, tpm_limit, expires_at
    key.tokens_per_day, key.tokens_per_month = tokens_per_day, tokens_per_month
    _set_secret(key, secret)
    key.created_at, key.created_by = now, actor
    with transaction.atomic():
        key.save()
        _record(key, "created", f"owner {owner.get_username()}", now=now, actor=actor, actor_name=actor_name)
        transaction.on_commit(lambda: notify.publish("keys"))
    return key, secret


def _set_secret(key: ApiKey, secret: str) -> None:
    key.prefix = secret[: len(KEY_PREFIX) + 6]
    key.key_hash = hash_secret(secret)


def _shown(value: Any) -> str:
    if hasattr(value, "get_username"):
        return value.get_username()
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return repr(value) if isinstance(value, str) else str(value)


def update(
    key_id: int,
    values: Mapping[str, Any],
    *,
    now: dt.datetime,
    actor: AbstractBaseUser | None,
    actor_name: str | None = None,
) -> ApiKey:
    """Change a key's CHANGEABLE fields; the event lists each change as old -> new. Returns the key.

    Only the fields whose value really changes are written and recorded; a
    change to nothing records nothing and pushes nothing.
    """
    unknown = set(values) - set(CHANGEABLE)
    if unknown:
        raise ValueError(f"not changeable: {', '.join(sorted(unknown))}")
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().get(id=key_id)
        diffs, fields = [], []
        for field in CHANGEABLE:
            if field not in values:
                continue
            new = sorted(set(values[field])) if field == "allowed_models" else values[field]
            old = getattr(key, field)
            if new != old:
                diffs.append(f"{field}: {_shown(old)} -> {_shown(new)}")
                fields.append(field)
                setattr(key, field, new)
        if fields:
            key.save(update_fields=fields)
            _record(key, "changed", "; ".join(diffs), now=now, actor=actor, actor_name=actor_name)
            transaction.on_commit(lambda: notify.publish("keys"))
    return key


def rotate(
    key_id: int, *, now: dt.datetime, actor: AbstractBaseUser | None = None, actor_name: str | None = None
) -> tuple[ApiKey, str]:
    """Give the key a new secret and return it with the secret (shown once); the old secret stops working.

    Raises KeyRefused for a revoked key: a revoked key stays revoked.
    """
    secret = new_secret()
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().get(id=key_id)
        if key.revoked_at is not None:
            raise KeyRefused(f"the key {key.name!r} is revoked; create a new key instead")
        old_prefix = key.prefix
        _set_secret(key, secret)
        key.save(update_fields=["prefix", "key_hash"])
        detail = f"secret {old_prefix}… replaced by {key.prefix}…"
        _record(key, "rotated", detail, now=now, actor=actor, actor_name=actor_name)
        transaction.on_commit(lambda: notify.publish("keys"))
    return key, secret


def revoke(
    key_id: int, *, now: dt.datetime, actor: AbstractBaseUser | None = None, actor_name: str | None = None
) -> bool:
    """Revoke a key (compare-and-set: False when it already was); every data plane drops it within a second."""
    with transaction.atomic():
        n = ApiKey.objects.filter(id=key_id, revoked_at__isnull=True).update(revoked_at=now)
        if not n:
            return False
        _record(ApiKey.objects.get(id=key_id), "revoked", "", now=now, actor=actor, actor_name=actor_name)
        transaction.on_commit(lambda: notify.publish("keys"))
    return True
