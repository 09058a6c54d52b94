"""Operator API tokens: how a person or a script gets one without the admin.

Backed by DRF's authtoken for now, which keeps one token per user; the
command line in front of it (`manage.py api_token create --user U --name N`)
stays as it is when the storage changes.
"""

from __future__ import annotations

from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db import transaction
from rest_framework.authtoken.models import Token


class TokenError(ValueError):
    """A token cannot be created as asked; the message says why and what to do."""


def create_api_token(username: str, name: str) -> str:
    """Create an API token for `username`, record who and what in the user's history, return its secret.

    The token is for `Authorization: Token <secret>`; it carries the user's
    permissions. The name is what the operator calls it ("ci", "grafana") and
    is kept in the user's admin history, never the secret.
    """
    name = name.strip()
    if not name:
        raise TokenError("name: give the token a name, e.g. --name ci")
    user_model = get_user_model()
    with transaction.atomic():
        try:
            user = user_model.objects.select_for_update().get(**{user_model.USERNAME_FIELD: username})
        except user_model.DoesNotExist:
            raise TokenError(f"user: no user {username!r} (see /admin/auth/user/ or manage.py ensure_admin)") from None
        if not user.is_active:
            raise TokenError(f"user: {username!r} is inactive")
        if Token.objects.filter(user=user).exists():
            raise TokenError(
                f"user: {username!r} already has an API token (one per user); "
                "delete it in Admin -> Auth Token -> Tokens to create another"
            )
        token = Token.objects.create(user=user)
        LogEntry.objects.create(
            user=user,
            content_type=ContentType.objects.get_for_model(user_model),
            object_id=str(user.pk),
            object_repr=str(user)[:200],
            action_flag=CHANGE,
            change_message=f"API token {name!r} created (manage.py api_token)",
        )
    return token.key
