"""Inventory in the Django admin: lists, filters, search, GPUs inline on the node.

Operator actions (cordon, drain, labels) are added by the cockpit in
inventory/admin_actions.py and call inventory/nodes.py like the API does.
"""

from django.contrib import admin

from inventory.models import (
    GPU,
    Allocation,
    EngineInstall,
    FabricAttachment,
    FabricScan,
    LocalWeights,
    Node,
    NodeEvent,
    SMChange,
    Storage,
)


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0
    can_delete = False
    fields = [
        "index",
        "gpu_class",
        "name",
        "uuid",
        "memory_total_mb",
        "numa_node",
        "fabric_state",
        "cluster_uuid",
        "clique_id",
        "fabric_bandwidth",
        "ecc_errors",
        "problems",
    ]
    readonly_fields = fields


class FabricInline(admin.TabularInline):
    model = FabricAttachment
    extra = 0
    can_delete = False
    fields = ["name", "hcas", "rate_gbps"]
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["id", "hostname", "state", "nvlink_domain", "imex_state", "agent_version", "last_seen"]
    list_filter = ["state", "nvlink_domain", "imex_state"]
    search_fields = ["id", "hostname", "gpus__uuid"]
    inlines = [GPUInline, FabricInline]
    readonly_fields = [
        "state",
        "unreachable_since",
        "last_seen",
        "registered_at",
        "agent_labels",
        "labels",
        "created_at",
        "updated_at",
    ]


@admin.register(GPU)
class GPUAdmin(admin.ModelAdmin):
    list_display = ["__str__", "gpu_class", "uuid", "memory_total_mb", "fabric_state", "cluster_uuid", "ecc_errors"]
    list_filter = ["gpu_class", "fabric_state"]
    search_fields = ["uuid", "node__id", "name"]
    autocomplete_fields = ["node"]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["node", "replica_id", "shard_id", "memory_gb", "cpu_cores", "power_w", "created_at"]
    search_fields = ["node__id", "replica_id", "shard_id"]
    autocomplete_fields = ["node"]


@admin.register(SMChange)
class SMChangeAdmin(admin.ModelAdmin):
    list_display = ["at", "node_id", "port", "from_guid", "to_guid"]
    search_fields = ["node_id", "from_guid", "to_guid"]


@admin.register(FabricScan)
class FabricScanAdmin(admin.ModelAdmin):
    list_display = ["key", "at", "node_id", "port", "took_s", "error"]
    search_fields = ["key", "node_id"]


@admin.register(NodeEvent)
class NodeEventAdmin(admin.ModelAdmin):
    list_display = ["at", "node", "kind", "actor_name", "message"]
    list_filter = ["kind"]
    search_fields = ["node__id", "message", "actor_name"]

    def has_add_permission(self, request):  # audit rows are written by llmgw alone
        return False

    def has_change_permission(self, request, obj=None):
        return False


for model in (FabricAttachment, Storage, LocalWeights, EngineInstall):
    admin.site.register(model, list_display=["__str__"], search_fields=["node__id"])
