"""The node list's filters (GPU class, fabric, NVLink domain, label) and its one-round-trip telemetry."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Q

from inventory import operations, telemetry
from inventory.models import (
    GPU,
    FabricAttachment,
    Node,
)


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
