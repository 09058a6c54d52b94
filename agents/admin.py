"""Join tokens, node credentials and the command queue in the admin.

A join token's secret is shown once, when it is created; only its hash is
kept. A node credential can be reset (the node must join again with a join
token) or the agent asked to rotate it; both call agents/credentials.py.
"""

from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

import llmgw_wire as wire
from agents import credentials
from agents.models import JoinToken, NodeCredential
from inventory.models import Command
from llmgw.admin import ReadOnlyAdmin


class JoinTokenForm(forms.ModelForm):
    """A new join token: a name, a lifetime, an optional use limit."""

    valid_for_hours = forms.IntegerField(min_value=1, max_value=24 * 365, initial=24, required=False)

    class Meta:
        model = JoinToken
        fields = ["name", "max_uses"]


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "expires_at", "uses", "max_uses", "revoked_at", "created_by", "created_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix"]
    readonly_fields = ["prefix", "uses", "expires_at", "revoked_at", "created_at", "created_by"]
    actions = ["revoke"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = JoinTokenForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "valid_for_hours", "max_uses"]
        return ["name", "prefix", "max_uses", "uses", "expires_at", "revoked_at", "created_at", "created_by"]

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        now = timezone.now()
        hours = form.cleaned_data.get("valid_for_hours") or 24
        _, secret = credentials.create_join_token(
            name=obj.name,
            expires_at=now + dt.timedelta(hours=hours),
            max_uses=obj.max_uses,
            now=now,
            created_by=request.user,
            token=obj,
        )
        self.message_user(
            request,
            f"Join token created. Copy it now, it is not shown again: {secret}",
            level=messages.WARNING,
        )

    @admin.action(description="Revoke the selected join tokens", permissions=["change"])
    def revoke(self, request, queryset):
        now = timezone.now()
        n = sum(credentials.revoke_join_token(t.id, now=now) for t in queryset)
        self.message_user(request, f"{n} join token(s) revoked.")


@admin.register(NodeCredential)
class NodeCredentialAdmin(admin.ModelAdmin):
    list_display = ["node", "issued_at", "issued_by", "rotation_pending", "rotation_requested_at"]
    search_fields = ["node__id", "node__hostname"]
    autocomplete_fields = ["node"]
    readonly_fields = ["node", "issued_at", "issued_by", "rotation_requested_at", "rotation_pending"]
    fields = readonly_fields
    actions = ["reset", "request_rotation"]

    def has_add_permission(self, request):
        # Credentials are issued to agents at registration, never typed in.
        return False

    @admin.display(boolean=True, description="old secret still valid")
    def rotation_pending(self, obj: NodeCredential) -> bool:
        return obj.previous_hash is not None

    @admin.action(
        description="Reset: revoke the credential now; the node must join again with a join token",
        permissions=["delete"],
    )
    def reset(self, request, queryset):
        now = timezone.now()
        n = sum(credentials.reset(c.node_id, now=now, actor=request.user) for c in list(queryset))
        self.message_user(request, f"{n} credential(s) reset.")

    @admin.action(
        description="Rotate: ask the agent for a new credential at its next heartbeat", permissions=["change"]
    )
    def request_rotation(self, request, queryset):
        now = timezone.now()
        n = sum(credentials.request_rotation(c.node_id, now=now, actor=request.user) for c in queryset)
        self.message_user(request, f"Rotation requested for {n} node(s).")


@admin.register(Command)
class CommandAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["id", "node", "kind", "shard_id", "created_at", "deliveries", "acked_at"]
    list_filter = ["kind", ("acked_at", admin.EmptyFieldListFilter)]
    search_fields = ["id", "node__id", "shard_id"]
    readonly_fields = [
        "id",
        "node",
        "kind",
        "shown_payload",
        "shard_id",
        "created_at",
        "first_delivered_at",
        "deliveries",
        "acked_at",
    ]
    fields = readonly_fields

    @admin.display(description="payload")
    def shown_payload(self, obj: Command) -> dict:
        """The command as sent, with a StartShard profile's secrets masked."""
        return wire.masked_command(obj.payload)

    deletable = True
