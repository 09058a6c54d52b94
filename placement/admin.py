"""Placement in the admin: profiles, deployments, replicas and shards with their states,
holds and power budgets, and the planner's reason node by node for a pending replica."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, Sum
from django.db.models.fields.json import KeyTextTransform
from django.db.models.lookups import Exact
from django.http import HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from inventory.models import Node
from llmgw.admin import ReadOnlyAdmin
from placement import audit, autoscale_chart, explain, kept, planner, queueing, replicas, retiring, secrets
from placement import deployments as deployment_actions
from placement.models import (
    AutoscaleSample,
    Deployment,
    EngineProfile,
    Hold,
    PlacementEvent,
    PowerBudget,
    Replica,
    ReplicaState,
    Shard,
)


class AuditedAdmin(admin.ModelAdmin):
    """Saves and deletes through placement.audit: each recorded with who and when."""

    def save_model(self, request, obj, form, change):
        audit.save(obj, now=timezone.now(), actor=request.user)

    def delete_model(self, request, obj):
        audit.delete([obj], now=timezone.now(), actor=request.user)

    def delete_queryset(self, request, queryset):
        audit.delete(queryset, now=timezone.now(), actor=request.user)


class EngineProfileForm(forms.ModelForm):
    """A profile's form with its secrets masked: left masked they keep their stored values."""

    class Meta:
        model = EngineProfile
        exclude: list[str] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, shown in (("env", secrets.shown_env), ("args", secrets.shown_args)):
            if name in self.fields:
                self.initial[name] = shown(self.initial.get(name))

    def _kept(self, name: str, keep):
        value = self.cleaned_data.get(name)
        if not isinstance(value, dict | list):
            return value  # the model's own validation says what is wrong
        try:
            return keep(value, getattr(self.instance, name) if self.instance.pk else None)
        except secrets.HiddenWithoutValue as e:
            raise forms.ValidationError(str(e)) from None

    def clean_env(self):
        """The env to store, masked secrets keeping their stored values."""
        return self._kept("env", secrets.kept_env)

    def clean_args(self):
        """The args to store, masked secret flag values keeping their stored values."""
        return self._kept("args", secrets.kept_args)


@admin.register(EngineProfile)
class EngineProfileAdmin(AuditedAdmin):
    form = EngineProfileForm
    list_display = ["name", "engine", "gpu_class", "tp", "pp", "gpus_per_node", "nodes", "memory_gb", "power_w"]
    list_filter = ["engine", "gpu_class"]
    search_fields = ["name", "model_path", "served_model_name"]
    readonly_fields = ["fingerprint", "created_at", "updated_at"]

    @admin.display(description="fingerprint")
    def fingerprint(self, obj: EngineProfile) -> str:
        return obj.fingerprint() if obj.pk else ""


class ReplicaInline(admin.TabularInline):
    model = Replica
    fk_name = "deployment"
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ["state", "reason", "endpoint", "nvlink_domain", "fabric_name", "profile_fp", "created_at", "ready_at"]
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).filter(state__in=replicas.LIVE_STATES)

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "served_model", "profile", "replicas", "ready", "pool", "policy", "paused"]
    list_filter = ["paused", "policy", "pool"]
    search_fields = ["name", "served_model"]
    autocomplete_fields = ["profile"]
    readonly_fields = ["created_at", "updated_at"]
    inlines = [ReplicaInline]
    actions = ["pause", "resume"]
    fieldsets = [
        (
            None,
            {"fields": ["name", "served_model", "profile", "replicas", "pool", "node_selector", "policy", "paused"]},
        ),
        (
            "Autoscaling",
            {
                "fields": [
                    "autoscale_metric",
                    ("autoscale_min", "autoscale_max"),
                    "autoscale_target",
                    ("scale_up_window_s", "scale_down_window_s"),
                ],
                "description": (
                    "With a metric, the reconciler sets the replicas between the minimum (0: scale to zero "
                    "when idle) and the maximum. The target is per replica for requests in flight and "
                    "requests waiting, in seconds for TTFT p95. The load must stay high for the scale-up "
                    "window before replicas are added, and low for the scale-down window before one is retired."
                ),
            },
        ),
        (None, {"fields": ["created_at", "updated_at"]}),
    ]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .select_related("profile")
            .annotate(ready_count=Count("replica_set", filter=Q(replica_set__state="ready")))
        )

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
        dep = self.get_object(request, object_id)
        if dep is not None and dep.autoscaled:
            extra_context.update(scaling_page(dep, timezone.now()))
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="ready", ordering="ready_count")
    def ready(self, obj: Deployment) -> str:
        return f"{obj.ready_count}/{obj.replicas}"

    def save_model(self, request, obj, form, change):
        before = Deployment.objects.filter(pk=obj.pk).first() if change else None
        super().save_model(request, obj, form, change)
        what = deployment_actions.changed(before, obj) or "nothing changed"
        deployment_actions.record(obj, "changed", f"saved in the admin: {what}", now=timezone.now(), actor=request.user)

    def delete_model(self, request, obj):
        deployment_actions.delete(obj, now=timezone.now(), actor=request.user)

    def delete_queryset(self, request, queryset):
        for dep in queryset:
            deployment_actions.delete(dep, now=timezone.now(), actor=request.user)

    def get_deleted_objects(self, objs, request):
        """What deleting takes with it; its replicas and shards go with it though nobody may delete them alone."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # The reconciler owns replicas and shards (their pages are read-only), so their missing
        # delete permission must not block deleting the deployment they belong to.
        owned = {str(Replica._meta.verbose_name), str(Shard._meta.verbose_name)}
        return deleted, counts, {p for p in perms_needed if str(p) not in owned}, protected

    def has_delete_permission(self, request, obj=None) -> bool:
        # Deleting would orphan running shards: scale to 0 first.
        if obj is not None and deployment_actions.deletable(obj):
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(description="Pause (leave its replicas alone)", permissions=["change"])
    def pause(self, request, queryset):
        for dep in queryset:
            deployment_actions.set_paused(dep, True, now=timezone.now(), actor=request.user)
        self.message_user(request, f"{queryset.count()} paused", messages.SUCCESS)

    @admin.action(description="Resume", permissions=["change"])
    def resume(self, request, queryset):
        for dep in queryset:
            deployment_actions.set_paused(dep, False, now=timezone.now(), actor=request.user)
        self.message_user(request, f"{queryset.count()} resumed", messages.SUCCESS)


# The span of the deployment page's autoscaling chart, and how many scaling steps it lists.
CHART_SPAN = dt.timedelta(hours=1)
STEPS_SHOWN = 20


def scaling_page(dep: Deployment, now: dt.datetime) -> dict:
    """What an autoscaled deployment's page shows above its form: the last hour's chart and recent steps."""
    start = now - CHART_SPAN
    rows = list(
        AutoscaleSample.objects.filter(deployment=dep, at__gte=start, at__lte=now)
        .order_by("at", "id")
        .values_list("at", "desired", "signal")
    )
    events = PlacementEvent.objects.filter(deployment=dep, kind="autoscaled")[:STEPS_SHOWN]
    return {"scaling_chart": autoscale_chart.chart(rows, start=start, end=now), "scaling_events": list(events)}


_OUTPUT_STYLE = "white-space: pre-wrap; font-family: monospace; max-height: 32em; overflow: auto; margin: 0"


def engine_output(shard: Shard) -> str:
    """A failed shard's end of its engine's output as it was written, line for line, escaped ("-" when none)."""
    if not shard.output_tail:
        return "-"
    return format_html('<pre class="engine-output" style="{}">{}</pre>', _OUTPUT_STYLE, shard.output_tail)


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    can_delete = False
    fields = [
        "rank",
        "node",
        "gpu_indices",
        "hcas",
        "http_port",
        "state",
        "reason",
        "engine_output",
        "profile_fp",
        "updated_at",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="engine output")
    def engine_output(self, obj: Shard) -> str:
        # Folded in the replica's table of shards: forty lines would push the next shard off the page.
        if not obj.output_tail:
            return "-"
        lines = obj.output_tail.count("\n") + 1
        return format_html("<details><summary>{} lines</summary>{}</details>", lines, engine_output(obj))


class EventInline(admin.TabularInline):
    model = PlacementEvent
    fk_name = "replica"
    extra = 0
    can_delete = False
    fields = ["at", "kind", "from_state", "to_state", "reason", "actor_name"]
    readonly_fields = fields
    ordering = ["-at", "-id"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["__str__", "deployment", "state", "endpoint", "where", "reason", "created_at"]
    list_filter = ["state", "deployment"]
    search_fields = ["id", "deployment__name", "shards__node__id", "endpoint"]
    list_select_related = ["deployment"]
    inlines = [ShardInline, EventInline]
    readonly_fields = [
        "deployment",
        "state",
        "reason",
        "pending_by_node",
        "why_link",
        "nvlink_domain",
        "fabric",
        "fabric_name",
        "endpoint",
        "profile_fp",
        "replaces",
        "created_at",
        "updated_at",
        "ready_at",
    ]
    exclude = ["pending_reasons"]
    change_form_template = "admin/placement/replica/change_form.html"

    # The reconciler owns replicas: an operator reads them, asks the planner,
    # and retires one; editing or deleting the row would lie about what runs.

    def can_retire(self, request) -> bool:
        """Whoever may change deployments may retire one of their replicas."""
        return request.user.has_perm("placement.change_deployment")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = dict(extra_context or {})
        replica = self.get_object(request, object_id)
        if replica is not None:
            extra.update(
                replica=replica,
                why_url=reverse("admin:placement_replica_why", args=[replica.pk]),
                retire_url=reverse("admin:placement_replica_retire", args=[replica.pk]),
                can_retire=self.can_retire(request) and replica.state in replicas.LIVE_STATES - {ReplicaState.DRAINING},
            )
        return super().change_view(request, object_id, form_url, extra_context=extra)

    @admin.display(description="where")
    def where(self, obj: Replica) -> str:
        return obj.nvlink_domain or obj.fabric_name or ""

    @admin.display(description="pending reason, node by node")
    def pending_by_node(self, obj: Replica) -> str:
        if not obj.pending_reasons:
            return "-"
        return format_html(
            "<table>{}</table>",
            format_html_join("", "<tr><td>{}</td><td>{}</td></tr>", sorted(obj.pending_reasons.items())),
        )

    @admin.display(description="where would it go now")
    def why_link(self, obj: Replica) -> str:
        if not obj.pk:
            return ""
        return format_html('<a href="{}">ask the planner</a>', reverse("admin:placement_replica_why", args=[obj.pk]))

    def get_urls(self):
        return [
            path("<uuid:pk>/why/", self.admin_site.admin_view(self.why_view), name="placement_replica_why"),
            path("<uuid:pk>/retire/", self.admin_site.admin_view(self.retire_view), name="placement_replica_retire"),
            *super().get_urls(),
        ]

    def why_view(self, request, pk):
        """The planner over a fresh snapshot, for this replica's deployment: the chosen nodes or why not,
        summarised (node by node with ?explain=all). Nothing is written."""
        replica = get_object_or_404(Replica.objects.select_related("deployment__profile"), pk=pk)
        if not self.has_view_permission(request, replica):
            raise PermissionDenied
        dep = replica.deployment
        req = planner.ReplicaRequest.from_profile(dep.profile, selector=dep.node_selector)
        result = planner.plan(req, kept.scratch(now=timezone.now()), policy=dep.policy, explain=True)
        every = request.GET.get("explain") == explain.EVERY_NODE
        context = {
            **self.admin_site.each_context(request),
            "title": f"Where would {dep.name} go now",
            "replica": replica,
            "deployment": dep,
            "result": result,
            # Thousands of nodes are read as a summary; every node's reason only when asked for.
            "shown": explain.shown(result, every=every),
            "every": every,
            "fits_shown": explain.FITS_SHOWN,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/placement/replica_why.html", context)

    def retire_view(self, request, pk):
        """Retire one replica after a confirmation page saying what it stops and what follows."""
        replica = get_object_or_404(Replica.objects.select_related("deployment"), pk=pk)
        if not self.can_retire(request):
            raise PermissionDenied
        page = reverse("admin:placement_replica_change", args=[replica.pk])
        if request.method == "POST":
            reason = request.POST.get("reason", "").strip()[:200]
            if retiring.retire_replica(replica.pk, now=timezone.now(), actor=request.user, reason=reason):
                queueing.queue_reconcile()
                self.message_user(request, f"retired {replica}: its shards are told to stop", messages.SUCCESS)
            else:
                self.message_user(request, f"not retired: {replica} is {replica.state}", messages.WARNING)
            return HttpResponseRedirect(page)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Retire {replica}?",
            "replica": replica,
            "shards": list(replica.shards.select_related("node").order_by("rank")),
            "page_url": page,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/placement/replica/retire.html", context)


@admin.register(Shard)
class ShardAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["__str__", "node", "rank", "gpu_indices", "http_port", "state", "reason", "updated_at"]
    list_filter = ["state"]
    search_fields = ["id", "node__id", "replica__deployment__name"]
    list_select_related = ["replica"]
    autocomplete_fields = ["node"]
    # The engine's output shown preformatted, not as the admin shows a text field (lines joined by <br>).
    exclude = ["output_tail"]
    readonly_fields = [*(f.name for f in Shard._meta.fields if f.name != "output_tail"), "engine_output"]

    # Written by the reconciler and the agents' reports alone: a view, not a form.

    @admin.display(description="engine output (its last lines when it failed)")
    def engine_output(self, obj: Shard) -> str:
        return engine_output(obj)


@admin.register(PlacementEvent)
class PlacementEventAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["at", "kind", "deployment", "replica", "from_state", "to_state", "reason", "actor_name"]
    list_filter = ["kind", "to_state"]
    search_fields = ["reason", "deployment__name", "actor_name"]
    list_select_related = ["deployment", "replica"]
    readonly_fields = [f.name for f in PlacementEvent._meta.fields]
    deletable = True


@admin.register(Hold)
class HoldAdmin(AuditedAdmin):
    list_display = ["__str__", "scope", "reason", "created_by", "created_at"]
    list_filter = ["scope"]
    search_fields = ["node__id", "label_key", "label_value", "fabric", "reason"]
    autocomplete_fields = ["node"]
    readonly_fields = ["created_by", "created_at"]


@admin.register(PowerBudget)
class PowerBudgetAdmin(AuditedAdmin):
    list_display = ["label_key", "label_value", "budget_w", "claimed"]
    search_fields = ["label_key", "label_value"]
    readonly_fields = ["created_at"]

    def get_changelist_instance(self, request):
        # What is claimed under each budget on this page, kept on the page's own rows.
        cl = super().get_changelist_instance(request)
        claimed = claimed_power(cl.result_list)
        for budget in cl.result_list:
            budget.claimed_w = claimed[budget.pk]
        return cl

    @admin.display(description="claimed (W)")
    def claimed(self, obj: PowerBudget) -> str:
        used = obj.claimed_w
        return f"{used:,.0f} ({used / obj.budget_w:.0%})" if obj.budget_w else f"{used:,.0f}"


def claimed_power(budgets: Iterable[PowerBudget]) -> dict[int, float]:
    """Each budget's claimed power (W): the allocations on the nodes carrying its label value,
    as the planner counts them, in one query."""
    sums = {
        f"b{b.pk}": Sum("allocations__power_w", filter=Exact(KeyTextTransform(b.label_key, "labels"), b.label_value))
        for b in budgets
    }
    totals = Node.objects.aggregate(**sums) if sums else {}
    return {int(alias[1:]): total or 0.0 for alias, total in totals.items()}
