"""Operator API tokens: created with a name and an expiry, stored as a digest, revoked by name.

django-rest-knox does the hashing and the authentication
(knox.auth.TokenAuthentication); these are the rules the admin and
`manage.py api_token` share.
"""

from __future__ import annotations

import datetime as dt

from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.contenttypes.models import ContentType
from django.db import IntegrityError, transaction
from knox.models import get_digest_token
from knox.settings import CONSTANTS, knox_settings

from llmgw.models import OperatorToken

MAX_DAYS = 3650


class TokenError(ValueError):
    """A token that cannot be created or revoked as asked; the message says why."""


def create(
    user: AbstractBaseUser, name: str, *, now: dt.datetime, days: int | None = None
) -> tuple[OperatorToken, str]:
    """A new token for `user` named `name`, expiring after `days` (the configured TTL by default).

    Returns the row and the secret; the secret is not kept anywhere, so the
    caller shows it once.
    """
    name = name.strip()
    if not name or len(name) > OperatorToken._meta.get_field("name").max_length or "\x00" in name:
        raise TokenError("a token needs a name of 1 to 128 characters")
    ttl = knox_settings.TOKEN_TTL if days is None else dt.timedelta(days=days)
    if days is not None and not 1 <= days <= MAX_DAYS:
        raise TokenError(f"a token lives 1 to {MAX_DAYS} days")
    digest, secret = get_digest_token()
    try:
        with transaction.atomic():
            row = OperatorToken.objects.model(
                digest=digest,
                token_key=secret[: CONSTANTS.TOKEN_KEY_LENGTH],
                user=user,
                name=name,
                expiry=now + ttl,
            )
            row.save(force_insert=True)
    except IntegrityError:
        raise TokenError(f"{user} already has a token named {name!r}: revoke it first") from None
    return row, secret


def revoke(user: AbstractBaseUser, name: str) -> int:
    """Delete `user`'s token named `name`; how many were deleted (0 or 1)."""
    deleted, _ = OperatorToken.objects.filter(user=user, name=name).delete()
    return deleted


def record(user: AbstractBaseUser, name: str, *, created: bool, via: str) -> None:
    """Keep a token's creation or revocation outside the admin in the admin's history, with who and how.

    The admin records its own; a token made or revoked from the command line
    would otherwise leave no trace of who could act as whom, and since when.
    """
    LogEntry.objects.create(
        user=user,
        content_type=ContentType.objects.get_for_model(OperatorToken),
        object_id="",
        object_repr=f"{user}: {name}"[:200],
        action_flag=ADDITION if created else DELETION,
        change_message=f"API token {name!r} {'created' if created else 'revoked'} ({via})",
    )
