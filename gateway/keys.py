"""API keys: create (the secret returned once), change, revoke; each recorded and pushed to the data planes."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.db import transaction

from gateway import notify
from gateway.models import ApiKey, KeyEvent

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

KEY_PREFIX = "llmgw-sk-"


def hash_secret(secret: str) -> str:
    """The stored (and in-memory) form of a key's secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    """A fresh 256-bit secret, prefixed so a leaked one is recognisable in logs and scanners."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _record(key: ApiKey, kind: str, detail: str, *, now: dt.datetime, actor: AbstractBaseUser | None) -> None:
    KeyEvent.objects.create(
        at=now,
        key=key,
        kind=kind,
        detail=detail,
        actor=actor,
        actor_name=actor.get_username() if actor is not None else "system",
    )


def create_key(
    *,
    name: str,
    owner: AbstractBaseUser,
    now: dt.datetime,
    allowed_models: Iterable[str] = (),
    rpm_limit: int = 0,
    tpm_limit: int = 0,
    expires_at: dt.datetime | None = None,
    actor: AbstractBaseUser | None = None,
    key: ApiKey | None = None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its secret, which is not kept anywhere: show it once.

    `key`, when given, is an unsaved instance to fill (the admin's form).
    """
    secret = new_secret()
    key = key or ApiKey()
    key.name, key.owner = name, owner
    key.allowed_models = sorted(set(allowed_models))
    key.rpm_limit, key.tpm_limit, key.expires_at = rpm_limit, tpm_limit, expires_at
    key.prefix = secret[: len(KEY_PREFIX) + 6]
    key.key_hash = hash_secret(secret)
    key.created_at, key.created_by = now, actor
    with transaction.atomic():
        key.save()
        _record(key, "created", f"owner {owner.get_username()}", now=now, actor=actor)
        transaction.on_commit(lambda: notify.publish("keys"))
    return key, secret


def changed(key: ApiKey, fields: Iterable[str], *, now: dt.datetime, actor: AbstractBaseUser | None) -> None:
    """Record that an operator changed a key's fields (already saved) and push the change."""
    names = ", ".join(sorted(fields))
    if not names:
        return
    with transaction.atomic():
        _record(key, "changed", f"changed: {names}", now=now, actor=actor)
        transaction.on_commit(lambda: notify.publish("keys"))


def revoke(key_id: int, *, now: dt.datetime, actor: AbstractBaseUser | None = None) -> bool:
    """Revoke a key (compare-and-set: False when it already was); every data plane drops it within a second."""
    with transaction.atomic():
        n = ApiKey.objects.filter(id=key_id, revoked_at__isnull=True).update(revoked_at=now)
        if not n:
            return False
        _record(ApiKey.objects.get(id=key_id), "revoked", "", now=now, actor=actor)
        transaction.on_commit(lambda: notify.publish("keys"))
    return True
