"""The node admin's actions, each behind a page that says what it will do before it does it."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from inventory import operations
from inventory.models import (
    Node,
)
from inventory.nodes import TransitionError

ACTIONS = {
    "cordon": (operations.cordon, "cordoned"),
    "uncordon": (operations.uncordon, "uncordoned"),
    "drain": (operations.drain, "draining"),
}


class NodeActions(admin.ModelAdmin):
    """Cordon, uncordon, drain and forget, for the node admin; each calls the function the REST API calls."""

    def _confirm(self, request: HttpRequest, queryset, name: str):
        impacts = operations.impact(name, queryset.order_by("id"), now=timezone.now())
        if request.POST.get("post") == "yes":
            fn, done_word = ACTIONS[name]
            now = timezone.now()
            done, refused = [], []
            for i in impacts:
                if not i.allowed:
                    refused.append(f"{i.node_id}: {i.reason}")
                    continue
                try:
                    fn(i.node_id, now=now, actor=request.user, reason=request.POST.get("reason", "").strip()[:500])
                    done.append(i.node_id)
                except TransitionError as exc:
                    refused.append(str(exc))
            if done:
                self.message_user(request, f"{done_word}: {', '.join(done)}", messages.SUCCESS)
            if refused:
                self.message_user(request, "not changed: " + "; ".join(refused), messages.WARNING)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": f"{name.capitalize()} nodes?",
            "action": name,
            "action_name": f"{name}_nodes",
            "impacts": impacts,
            "moving": sum(len(i.replicas) for i in impacts if i.allowed),
            "opts": self.model._meta,
            "queryset": queryset,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/inventory/node/action_confirmation.html", context)

    @admin.action(permissions=["cordon"], description="Cordon: no new replicas on these nodes")
    def cordon_nodes(self, request, queryset):
        return self._confirm(request, queryset, "cordon")

    @admin.action(permissions=["cordon"], description="Uncordon: give these nodes back to placement")
    def uncordon_nodes(self, request, queryset):
        return self._confirm(request, queryset, "uncordon")

    @admin.action(permissions=["drain"], description="Drain: move these nodes' replicas elsewhere")
    def drain_nodes(self, request, queryset):
        return self._confirm(request, queryset, "drain")

    @admin.action(permissions=["forget"], description="Forget these nodes (refused while they hold anything)")
    def forget_nodes(self, request, queryset):
        nodes = list(queryset.order_by("id"))
        verdicts = [(n, operations.forget_refusal(n)) for n in nodes]
        if request.POST.get("post") == "yes":
            forgotten, refused = [], []
            for n, refusal in verdicts:
                if refusal:
                    refused.append(refusal)
                    continue
                try:
                    with transaction.atomic():  # the log entry only if the node really went
                        self.log_deletions(request, Node.objects.filter(id=n.id))
                        operations.forget(n.id, now=timezone.now(), actor=request.user)
                except operations.ForgetRefused as exc:
                    refused.append(str(exc))
                    continue
                forgotten.append(n.id)
            if forgotten:
                self.message_user(request, f"forgotten: {', '.join(forgotten)}", messages.SUCCESS)
            if refused:
                self.message_user(request, "refused: " + "; ".join(refused), messages.ERROR)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Forget nodes?",
            "action": "forget",
            "action_name": "forget_nodes",
            "forget": verdicts,
            "opts": self.model._meta,
            "queryset": queryset,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/inventory/node/action_confirmation.html", context)

    def delete_model(self, request, obj):
        operations.forget(obj.id, now=timezone.now(), actor=request.user)
