"""The node admin: the list, the permissions to act, the node page and its labels."""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.db.models import Prefetch
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from inventory import gpus as gpu_rules
from inventory import hooks, node_view, operations
from inventory.admin.filters import FabricFilter, GPUClassFilter, LabelFilter, NodeChangeList, NVLinkDomainFilter
from inventory.admin.node_actions import NodeActions
from inventory.models import (
    GPU,
    FabricAttachment,
    Node,
    NodeEvent,
    NodeState,
)
from inventory.resources import free_gpu_indices


class FabricInline(admin.TabularInline):
    model = FabricAttachment
    extra = 0
    can_delete = False
    fields = ["name", "hcas", "rate_gbps"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(NodeActions):
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
