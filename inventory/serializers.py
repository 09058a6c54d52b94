"""Inventory API shapes: output serializers apart from the validators of what operators send."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from inventory import doctor, operations
from inventory.models import GPU, FabricAttachment, Node
from inventory.resources import free_gpu_indices


# Named apart from the wire schema's GPU and FabricAttachment (what an agent sends),
# which share the API document.
@extend_schema_serializer(component_name="NodeGPU")
class GPUOut(serializers.ModelSerializer):
    """A GPU as the API shows it."""

    node = serializers.CharField(source="node_id", read_only=True)
    nvlink_domain = serializers.CharField(read_only=True)
    healthy = serializers.BooleanField(read_only=True)

    class Meta:
        model = GPU
        fields = [
            "node",
            "index",
            "uuid",
            "name",
            "gpu_class",
            "memory_total_mb",
            "numa_node",
            "pci_bus_id",
            "nvlink_peers",
            "nic_paths",
            "fabric_state",
            "fabric_status",
            "cluster_uuid",
            "clique_id",
            "fabric_bandwidth",
            "fabric_health",
            "nvlink_domain",
            "ecc_errors",
            "healthy",
            "problems",
        ]
        read_only_fields = fields


@extend_schema_serializer(component_name="NodeFabric")
class FabricAttachmentOut(serializers.ModelSerializer):
    """A node's declared fabric."""

    class Meta:
        model = FabricAttachment
        fields = ["name", "hcas", "rate_gbps"]
        read_only_fields = fields


@extend_schema_serializer(component_name="Node")
class NodeOut(serializers.ModelSerializer):
    """A node with its GPUs, fabrics, labels and how many GPUs are free.

    Needs `gpus`, `fabrics` and `allocated_gpus` prefetched (the viewset does).
    """

    gpus = GPUOut(many=True, read_only=True)
    fabrics = FabricAttachmentOut(many=True, read_only=True)
    reachable = serializers.BooleanField(read_only=True)
    imex_up = serializers.SerializerMethodField()
    gpus_total = serializers.SerializerMethodField()
    gpus_free = serializers.SerializerMethodField()
    gpu_classes = serializers.SerializerMethodField()
    effective_labels = serializers.DictField(source="labels", child=serializers.CharField(), read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "hostname",
            "mgmt_addr",
            "state",
            "reachable",
            "unreachable_since",
            "last_seen",
            "registered_at",
            "agent_version",
            "gpus_total",
            "gpus_free",
            "gpu_classes",
            "memory_total_mb",
            "cpu_count",
            "agent_labels",
            "operator_labels",
            "effective_labels",
            "nvlink_domain",
            "imex_state",
            "imex_channels",
            "imex_up",
            "fabrics",
            "gpus",
        ]
        read_only_fields = fields

    def get_imex_up(self, node: Node) -> bool:
        return node.imex_up()

    def get_gpus_total(self, node: Node) -> int:
        return len(node.gpus.all())

    def get_gpus_free(self, node: Node) -> int:
        return len(free_gpu_indices(node.gpus.all(), [a.gpu_index for a in node.allocated_gpus.all()]))

    def get_gpu_classes(self, node: Node) -> list[str]:
        return sorted({g.gpu_class for g in node.gpus.all() if g.gpu_class})


@extend_schema_serializer(component_name="ActionInput")
class ActionIn(serializers.Serializer):
    """What an operator may say with cordon, uncordon or drain."""

    reason = serializers.CharField(required=False, allow_blank=True, max_length=500, default="")


@extend_schema_serializer(component_name="LabelsInput")
class LabelsIn(serializers.Serializer):
    """Operator labels: PUT replaces them all; PATCH sets some and removes those given as null."""

    labels = serializers.DictField(child=serializers.CharField(allow_blank=True, allow_null=True, max_length=63))

    def validate_labels(self, value: dict) -> dict:
        partial = bool(self.context.get("partial"))
        errors = {}
        checked = {}
        for k, v in value.items():
            if v is None:
                if not partial:
                    errors[k] = ["null removes a label, only with PATCH"]
                    continue
                if not operations.LABEL_KEY.match(k):
                    errors[k] = [operations.KEY_RULE]
                checked[k] = None
                continue
            try:
                operations.validate_labels({k: v})
            except operations.LabelError as exc:
                errors[k] = [exc.message]
                continue
            checked[k] = v
        if errors:
            raise serializers.ValidationError(errors)
        return checked


@extend_schema_serializer(component_name="AffectedReplica")
class AffectedReplicaOut(serializers.Serializer):
    """A replica an action touches."""

    replica_id = serializers.CharField()
    deployment = serializers.CharField()
    replica_state = serializers.CharField()
    shards = serializers.ListField(child=serializers.CharField())


class NodeActionOut(serializers.Serializer):
    """The answer to cordon and uncordon: the node as the action left it."""

    node = NodeOut(read_only=True)


class DrainOut(NodeActionOut):
    """The answer to drain: the node, and the replicas that will move off it."""

    replicas_to_move = AffectedReplicaOut(many=True, read_only=True)


class LabelsOut(serializers.Serializer):
    """A node's labels after a change: the agent's, the operator's, and the agent's overlaid by the operator's."""

    agent_labels = serializers.DictField(child=serializers.CharField(), read_only=True)
    operator_labels = serializers.DictField(child=serializers.CharField(), read_only=True)
    effective_labels = serializers.DictField(child=serializers.CharField(), read_only=True)


@extend_schema_serializer(component_name="ActionInputErrors")
class ActionInErrors(serializers.Serializer):
    """400 from cordon, uncordon or drain: what is wrong with the reason."""

    reason = serializers.ListField(child=serializers.CharField(), read_only=True)


@extend_schema_serializer(component_name="LabelsInputErrors")
class LabelsInErrors(serializers.Serializer):
    """400 from a labels change: the problems of each label by key, or of the `labels` field itself (a list)."""

    labels = serializers.JSONField(read_only=True)


class StateConflictOut(serializers.Serializer):
    """409: the node's state does not allow the action."""

    state = serializers.ListField(child=serializers.CharField(), read_only=True)


class ForgetConflictOut(serializers.Serializer):
    """409: the node still holds allocations or shards not stopped, so it cannot be forgotten."""

    node = serializers.ListField(child=serializers.CharField(), read_only=True)


@extend_schema_serializer(component_name="Card")
class CardOut(serializers.Serializer):
    """One GPU on an NVLink tray."""

    index = serializers.IntegerField()
    state = serializers.CharField()
    fabric_state = serializers.CharField()
    fabric_status = serializers.CharField()
    bandwidth = serializers.CharField()
    uuid = serializers.CharField()


@extend_schema_serializer(component_name="Tray")
class TrayOut(serializers.Serializer):
    """One node of an NVLink domain."""

    node_id = serializers.CharField()
    hostname = serializers.CharField()
    node_state = serializers.CharField()
    reachable = serializers.BooleanField()
    imex_state = serializers.CharField()
    imex_channels = serializers.IntegerField()
    imex_up = serializers.BooleanField()
    state = serializers.CharField()
    cards = CardOut(many=True)
    reasons = serializers.ListField(child=serializers.CharField())
    warnings = serializers.ListField(child=serializers.CharField())


@extend_schema_serializer(component_name="Rack")
class RackOut(serializers.Serializer):
    """One NVLink domain ("" for cards that name none) with its trays."""

    domain = serializers.CharField()
    cluster_uuid = serializers.CharField()
    clique = serializers.CharField()
    joined = serializers.IntegerField()
    trays = TrayOut(many=True)


@extend_schema_serializer(component_name="CheckResult")
class CheckResultOut(serializers.Serializer):
    """One check's answer."""

    name = serializers.CharField()
    result = serializers.ChoiceField(choices=[r.value for r in doctor.Result])
    summary = serializers.CharField()
    action = serializers.CharField(allow_blank=True)
    nodes = serializers.ListField(child=serializers.CharField())
    details = serializers.ListField(child=serializers.CharField())


@extend_schema_serializer(component_name="DoctorReport")
class DoctorReportOut(serializers.Serializer):
    """The doctor's report: the worst verdict and every check."""

    at = serializers.DateTimeField()
    result = serializers.ChoiceField(choices=[r.value for r in doctor.Result])
    checks = CheckResultOut(many=True)
