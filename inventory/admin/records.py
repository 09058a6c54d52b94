"""The records the agents and llmgw write, read-only in the admin: GPUs, allocations, SM changes, scans, events."""

from __future__ import annotations

from django.contrib import admin

from inventory.models import (
    GPU,
    Allocation,
    EngineInstall,
    FabricAttachment,
    FabricScan,
    LocalWeights,
    NodeEvent,
    SMChange,
    Storage,
)
from llmgw.admin import ReadOnlyAdmin


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
    list_display = ["at", "node_label", "kind", "actor_name", "message"]
    list_filter = ["kind"]
    # node_id and node_name: a forgotten node's history is found by its id as before.
    search_fields = ["node__id", "node_name", "message", "actor_name"]

    @admin.display(description="node", ordering="node_id")
    def node_label(self, obj: NodeEvent) -> str:
        """The node's id, also once it is forgotten."""
        return obj.node_label


for model in (FabricAttachment, Storage, LocalWeights, EngineInstall):
    admin.site.register(model, list_display=["__str__"], search_fields=["node__id"])
