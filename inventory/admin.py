"""The operator's cockpit for the inventory: the node list, node pages and actions.

Actions are thin: each calls the function in inventory/operations.py that the
REST API calls too, behind a confirmation page that lists what it affects.
The inventory itself is the agents' report, so nodes are read-only here;
what an operator changes is state, operator labels, and whether a node is
remembered at all.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Prefetch, Q
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from inventory import gpus as gpu_rules
from inventory import hooks, node_view, operations, telemetry
from inventory.models import (
    GPU,
    Allocation,
    EngineInstall,
    FabricAttachment,
    FabricScan,
    LocalWeights,
    Node,
    NodeEvent,
    NodeState,
    SMChange,
    Storage,
)
from inventory.nodes import TransitionError
from inventory.resources import free_gpu_indices
from llmgw.admin import ReadOnlyAdmin

ACTIONS = {
    "cordon": (operations.cordon, "cordoned"),
    "uncordon": (operations.uncordon, "uncordoned"),
    "drain": (operations.drain, "draining"),
}


class _HasRowFilter(admin.SimpleListFilter):
    """Nodes with at least one row of `model` whose `field` is the chosen value; the choices are those in use."""

    model: type[GPU] | type[FabricAttachment]
    field: str

    def lookups(self, request, model_admin):
        values = self.model.objects.exclude(**{self.field: ""}).values_list(self.field, flat=True).distinct()
        return [(v, v) for v in sorted(set(values))]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(id__in=self.model.objects.filter(**{self.field: self.value()}).values("node_id"))
        return queryset


class GPUClassFilter(_HasRowFilter):
    """Nodes with at least one card of a class."""

    title = "GPU class"
    parameter_name = "gpu_class"
    model, field = GPU, "gpu_class"


class FabricFilter(_HasRowFilter):
    """Nodes attached to a declared fabric."""

    title = "fabric"
    parameter_name = "fabric"
    model, field = FabricAttachment, "name"


class NVLinkDomainFilter(admin.SimpleListFilter):
    """Nodes in an NVLink domain, or in none."""

    title = "NVLink domain"
    parameter_name = "nvlink_domain"

    def lookups(self, request, model_admin):
        domains = Node.objects.exclude(nvlink_domain="").values_list("nvlink_domain", flat=True).distinct()
        return [("-", "none"), *[(d, d) for d in sorted(set(domains))]]

    def queryset(self, request, queryset):
        v = self.value()
        if v == "-":
            return queryset.filter(nvlink_domain="")
        if v:
            return queryset.filter(nvlink_domain=v)
        return queryset


class LabelFilter(admin.SimpleListFilter):
    """Nodes by effective label, key=value."""

    title = "label"
    parameter_name = "label"

    def lookups(self, request, model_admin):
        pairs = set()
        for labels in Node.objects.values_list("labels", flat=True):
            pairs.update(f"{k}={v}" for k, v in (labels or {}).items())
        return [(p, p) for p in sorted(pairs)]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        key, _, value = self.value().partition("=")
        if not operations.LABEL_KEY.match(key):
            return queryset.none()
        return queryset.filter(Q(**{f"labels__{key}": value}))


class NodeChangeList(ChangeList):
    """The node list, with each shown node's telemetry fetched in one round trip."""

    def get_results(self, request):
        super().get_results(request)
        found = telemetry.get_many(n.id for n in self.result_list)
        for n in self.result_list:
            n.cached_telemetry = found.get(n.id)


class FabricInline(admin.TabularInline):
    model = FabricAttachment
    extra = 0
    can_delete = False
    fields = ["name", "hcas", "rate_gbps"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "state_column",
        "gpus_column",
        "fabrics_column",
        "domain_column",
        "imex_column",
        "last_seen_column",
        "agent_version",
        "problems_column",
    ]
    list_filter = ["state", GPUClassFilter, FabricFilter, NVLinkDomainFilter, LabelFilter]
    search_fields = ["id", "hostname", "gpus__uuid"]
    search_help_text = "node id, hostname or GPU UUID"
    actions = ["cordon_nodes", "uncordon_nodes", "drain_nodes", "forget_nodes"]
    inlines = [FabricInline]
    list_per_page = 100
    change_form_template = "admin/inventory/node/change_form.html"
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "hostname",
                    "mgmt_addr",
                    "metrics_addr",
                    "state",
                    "unreachable_since",
                    "last_seen",
                    "registered_at",
                ]
            },
        ),
        (
            "Agent",
            {"fields": ["agent_version", "features", "engine_versions", "engines_probed"], "classes": ["collapse"]},
        ),
        (
            "Host",
            {
                "fields": [
                    "os_id",
                    "os_version",
                    "arch",
                    "nvidia_driver",
                    "memory_total_mb",
                    "cpu_count",
                ],
                "classes": ["collapse"],
            },
        ),
        ("NVLink", {"fields": ["nvlink_domain", "imex_state", "imex_channels"]}),
    ]

    # --- permissions: look at everything, act only with the operator's permissions

    def has_add_permission(self, request):
        return False  # nodes join by registering

    def has_change_permission(self, request, obj=None):
        return False  # the inventory is the agent's report; operators act through actions

    def has_delete_permission(self, request, obj=None):
        # Django's delete would cascade through GPUs and history without the
        # checks Forget makes (allocations, shards): Forget is the one way out.
        return False

    def has_cordon_permission(self, request):
        return request.user.has_perm("inventory.cordon_node")

    def has_drain_permission(self, request):
        return request.user.has_perm("inventory.drain_node")

    def has_forget_permission(self, request):
        return request.user.has_perm("inventory.forget_node")

    def has_labels_permission(self, request):
        return request.user.has_perm("inventory.change_labels")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # "forget" says what it refuses
        return actions

    # --- the list

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .prefetch_related(Prefetch("gpus", queryset=GPU.objects.order_by("index")), "fabrics", "allocated_gpus")
        )

    def get_changelist(self, request, **kwargs):
        return NodeChangeList

    def changelist_view(self, request, extra_context=None):
        # The cockpit's own bar links every page: the app sidebar would take
        # the width the node list needs to show every column on one line.
        return super().changelist_view(request, {**(extra_context or {}), "is_nav_sidebar_enabled": False})

    @admin.display(description="state", ordering="state")
    def state_column(self, node: Node):
        badges = [format_html('<span class="lg-state lg-state-{}">{}</span>', node.state, node.state)]
        if not node.reachable and node.state not in (NodeState.UNREACHABLE, NodeState.LOST):
            badges.append(format_html('<span class="lg-state lg-state-unreachable">{}</span>', "unreachable"))
        return format_html_join(" ", "{}", ((b,) for b in badges))

    @admin.display(description="GPUs free/total")
    def gpus_column(self, node: Node):
        cards = list(node.gpus.all())
        free = len(free_gpu_indices(cards, [a.gpu_index for a in node.allocated_gpus.all()]))
        classes = ", ".join(sorted({g.gpu_class for g in cards if g.gpu_class})) or "-"
        return format_html(
            '<span class="lg-gpus">{}/{}</span> <span class="lg-dim">{}</span>', free, len(cards), classes
        )

    @admin.display(description="fabrics")
    def fabrics_column(self, node: Node):
        return ", ".join(f.name for f in node.fabrics.all()) or "-"

    @admin.display(description="NVLink domain", ordering="nvlink_domain")
    def domain_column(self, node: Node):
        if not node.nvlink_domain:
            return "-"
        return format_html('<span title="{}">{}…</span>', node.nvlink_domain, node.nvlink_domain[:13])

    @admin.display(description="IMEX")
    def imex_column(self, node: Node):
        if not node.imex_state:
            return "-"
        cls = "ok" if gpu_rules.imex_up(node.imex_state) else "bad"
        return format_html('<span class="lg-{}">{}</span> ({} ch)', cls, node.imex_state, node.imex_channels)

    @admin.display(description="last seen", ordering="last_seen")
    def last_seen_column(self, node: Node):
        return format_html(
            '<span title="{}">{}</span>',
            node.last_seen.isoformat() if node.last_seen else "",
            node_view.age(node.last_seen, timezone.now()),
        )

    @admin.display(description="problems")
    def problems_column(self, node: Node):
        problems = node_view.node_problems(node, getattr(node, "cached_telemetry", None), gpus=list(node.gpus.all()))
        if not problems:
            return format_html('<span class="lg-ok">{}</span>', 0)
        return format_html('<span class="lg-bad" title="{}">{}</span>', "\n".join(problems), len(problems))

    # --- actions, each with a page saying what it will do

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
                        operations.forget(n.id)
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
        operations.forget(obj.id)

    # --- the node page

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/labels/",
                self.admin_site.admin_view(self.labels_view),
                name="{}_{}_labels".format(*info),
            ),
            *super().get_urls(),
        ]

    def labels_view(self, request: HttpRequest, object_id: str):
        """The operator-label editor: agent's labels read-only, the operator's editable, the effective result."""
        node = get_object_or_404(Node, id=object_id)
        if not self.has_view_permission(request, node):
            raise PermissionDenied
        error = None
        text = operations.label_lines(node.operator_labels)
        if request.method == "POST":
            if not self.has_labels_permission(request):
                raise PermissionDenied
            text = request.POST.get("operator_labels", "")
            try:
                labels = operations.parse_label_lines(text)
                operations.change_labels(node.id, labels, now=timezone.now(), actor=request.user)
            except operations.LabelError as exc:
                error = exc
            else:
                self.message_user(request, f"labels of {node.id} saved", messages.SUCCESS)
                return HttpResponseRedirect(reverse("admin:inventory_node_change", args=[quote(node.id)]))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Labels of {node.id}",
            "node": node,
            "opts": self.opts,
            "labels_text": text,
            "label_error": error,
            "can_change_labels": self.has_labels_permission(request),
        }
        return TemplateResponse(request, "admin/inventory/node/labels.html", context, status=400 if error else 200)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        node = self.get_object(request, object_id)
        extra = dict(extra_context or {})
        if node is not None:
            shards = hooks.workloads().node_shards(node)
            allocations = list(node.allocations.prefetch_related("gpus").order_by("created_at"))
            extra.update(
                page=node_view.node_page(node, holders=node_view.gpu_holders(allocations, shards)),
                drain=operations.drain_progress(node),
                history=list(NodeEvent.objects.filter(node=node).order_by("-at", "-id")[:50]),
                shards=shards,
                allocations=allocations,
                can_forget=self.has_forget_permission(request),
                storage=list(node.storage.all()),
                weights=list(node.weights.all()),
                installs=list(node.engine_installs.all()),
                labels_text=operations.label_lines(node.operator_labels),
                can_change_labels=self.has_labels_permission(request),
                can_cordon=self.has_cordon_permission(request),
                can_drain=self.has_drain_permission(request),
                labels_url=reverse("admin:inventory_node_labels", args=[quote(node.id)]),
                forget_refusal=operations.forget_refusal(node),
                now=timezone.now(),
                credential=node_view.credential_box(node),
                # Rotate needs change, reset needs delete: the credential admin offers each by permission.
                can_manage_credential=request.user.has_perm("agents.change_nodecredential")
                or request.user.has_perm("agents.delete_nodecredential"),
                credential_url=reverse("admin:agents_nodecredential_change", args=[quote(node.id)]),
                credential_actions_url=reverse("admin:agents_nodecredential_changelist")
                + "?"
                + urlencode({"node": node.id}),
            )
        return super().change_view(request, object_id, form_url, extra_context=extra)


@admin.register(GPU)
class GPUAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["__str__", "gpu_class", "uuid", "memory_total_mb", "fabric_state", "cluster_uuid", "ecc_errors"]
    list_filter = ["gpu_class", "fabric_state"]
    search_fields = ["uuid", "node__id", "name"]
    autocomplete_fields = ["node"]
    list_select_related = ["node"]
    deletable = True


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["node", "replica_id", "shard_id", "gpu_list", "memory_gb", "cpu_cores", "power_w", "created_at"]
    search_fields = ["node__id", "replica_id", "shard_id"]
    autocomplete_fields = ["node"]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("gpus")

    @admin.display(description="GPUs")
    def gpu_list(self, obj: Allocation) -> str:
        return ",".join(map(str, obj.gpu_indices)) or "-"

    # The reconciler claims and releases these in its own transactions: a
    # hand-made or hand-deleted claim would double-book or strand GPUs.


@admin.register(SMChange)
class SMChangeAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["at", "node_id", "port", "from_guid", "to_guid"]
    search_fields = ["node_id", "from_guid", "to_guid"]
    deletable = True


@admin.register(FabricScan)
class FabricScanAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["key", "at", "node_id", "port", "took_s", "error"]
    search_fields = ["key", "node_id"]
    deletable = True


@admin.register(NodeEvent)
class NodeEventAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["at", "node", "kind", "actor_name", "message"]
    list_filter = ["kind"]
    search_fields = ["node__id", "message", "actor_name"]
    list_select_related = ["node"]


for model in (FabricAttachment, Storage, LocalWeights, EngineInstall):
    admin.site.register(model, list_display=["__str__"], search_fields=["node__id"])
