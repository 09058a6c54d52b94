"""The project's own tables: operator API tokens."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from knox.models import AbstractAuthToken


class OperatorToken(AbstractAuthToken):
    """An operator's API token: only its SHA-512 digest is kept, it expires, and it has a name.

    The secret is shown once, when created (admin or `manage.py api_token
    create`); a copy of the database lets no one call the API. The name is
    how an operator tells tokens apart and revokes one (`api_token revoke`).
    """

    name = models.CharField(max_length=128, help_text="What the token is for (a script, a CI job, a person's laptop).")

    class Meta:
        ordering = ["user_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["user", "name"], name="llmgw_operator_token_name_unique_per_user"),
            models.CheckConstraint(condition=~Q(name=""), name="llmgw_operator_token_named"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.token_key}…) of {self.user}"
