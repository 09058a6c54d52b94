"""Operator API tokens in the admin: created with a name and a lifetime, shown once, revoked by deleting."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.http import HttpRequest
from django.utils import timezone

from llmgw import tokens
from llmgw.models import OperatorToken


class ReadOnlyAdmin:
    """Rows llmgw writes alone (reports, audit trails, commands): an operator reads them, never types or edits one.

    Mixed in before ModelAdmin. `deletable` lets an operator still delete
    rows (pruning a report), which the admin's own delete permission then
    decides.
    """

    deletable = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: these rows come from the control plane or the agents."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: what was recorded stays as it was recorded."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Only for `deletable` admins, and then as the user's permissions say."""
        return self.deletable and super().has_delete_permission(request, obj)  # type: ignore[misc]


class TokenCreateForm(forms.ModelForm):
    """The add form: whose token, its name, how many days it lives."""

    days = forms.IntegerField(min_value=1, max_value=tokens.MAX_DAYS, initial=90, help_text="Lifetime in days.")

    class Meta:
        model = OperatorToken
        fields = ["user", "name"]

    def clean(self):
        data = super().clean()
        user, name = data.get("user"), data.get("name")
        if user and name and OperatorToken.objects.filter(user=user, name=name.strip()).exists():
            raise forms.ValidationError({"name": f"{user} already has a token named {name!r}: revoke it first"})
        return data


@admin.register(OperatorToken)
class OperatorTokenAdmin(admin.ModelAdmin):
    """Tokens listed by name, owner and expiry; the secret is never shown again after creation."""

    list_display = ("name", "user", "token_key", "created", "expiry")
    list_filter = ("user",)
    search_fields = ("name", "token_key", f"user__{get_user_model().USERNAME_FIELD}")
    readonly_fields = ("name", "user", "token_key", "created", "expiry")
    fields = ("name", "user", "token_key", "created", "expiry")
    raw_id_fields = ("user",)

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = TokenCreateForm
            kwargs["fields"] = ["user", "name", "days"]
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ["user", "name", "days"] if obj is None else list(self.fields)

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.readonly_fields

    def has_change_permission(self, request, obj=None) -> bool:
        # A token is created or revoked, never edited: its owner and expiry are what it was issued with.
        return False if obj is not None else super().has_change_permission(request, obj)

    def save_model(self, request, obj, form, change) -> None:
        row, secret = tokens.create(
            form.cleaned_data["user"], form.cleaned_data["name"], now=timezone.now(), days=form.cleaned_data["days"]
        )
        obj.pk = row.pk
        obj.digest, obj.token_key, obj.expiry, obj.created = row.digest, row.token_key, row.expiry, row.created
        shown = f"Token {row.name!r} for {row.user}: {secret} (copy it now: it is not shown again)"
        self.message_user(request, shown, messages.WARNING)
