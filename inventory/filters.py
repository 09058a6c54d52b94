"""Filters of the inventory API: state, GPU class, fabric, NVLink domain, label."""

from __future__ import annotations

import django_filters
from django.db.models import Q, QuerySet
from rest_framework.exceptions import ValidationError

from inventory import operations
from inventory.models import GPU, Node, NodeState


def filter_label(queryset: QuerySet, value: str) -> QuerySet:
    """Nodes whose effective labels have `key=value` (or merely `key`)."""
    key, sep, val = value.partition("=")
    key = key.strip()
    if not operations.LABEL_KEY.match(key):
        raise ValidationError({"label": [f"{key!r} is not a valid label key (use key=value)"]})
    if sep:
        return queryset.filter(Q(**{f"labels__{key}": val.strip()}))
    return queryset.filter(labels__has_key=key)


class NodeFilter(django_filters.FilterSet):
    """?state=, ?gpu_class=, ?fabric=, ?nvlink_domain=, ?label=key=value."""

    state = django_filters.ChoiceFilter(choices=NodeState.choices)
    gpu_class = django_filters.CharFilter(method="filter_gpu_class")
    fabric = django_filters.CharFilter(method="filter_fabric")
    nvlink_domain = django_filters.CharFilter()
    label = django_filters.CharFilter(method="filter_label")

    class Meta:
        model = Node
        fields = ["state", "nvlink_domain"]

    def filter_gpu_class(self, queryset, name, value):
        return queryset.filter(id__in=GPU.objects.filter(gpu_class=value).values("node_id"))

    def filter_fabric(self, queryset, name, value):
        return queryset.filter(fabrics__name=value).distinct()

    def filter_label(self, queryset, name, value):
        return filter_label(queryset, value)


class GPUFilter(django_filters.FilterSet):
    """?node=, ?gpu_class=, ?fabric_state=."""

    node = django_filters.CharFilter(field_name="node_id")

    class Meta:
        model = GPU
        fields = ["node", "gpu_class", "fabric_state"]
