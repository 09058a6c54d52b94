"""Placement's API shapes: input validators apart from output serializers."""

from __future__ import annotations

from rest_framework import serializers

from placement.models import Deployment, Engine, EngineProfile, Hold, PlacementEvent, PowerBudget, Replica, Shard
from placement.planner import BINPACK, SPREAD


def _string_map(value, field: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise serializers.ValidationError(f"{field} must be an object of strings")
    return value


class ProfileOut(serializers.ModelSerializer):
    """An engine profile as read, with its fingerprint."""

    fingerprint = serializers.SerializerMethodField()

    class Meta:
        model = EngineProfile
        fields = [
            "id",
            "name",
            "engine",
            "engine_version",
            "gpu_class",
            "tp",
            "pp",
            "gpus_per_node",
            "nodes",
            "memory_gb",
            "cpu_cores",
            "power_w",
            "disk_gb",
            "args",
            "env",
            "model_path",
            "served_model_name",
            "startup_timeout_s",
            "fingerprint",
            "created_at",
            "updated_at",
        ]

    def get_fingerprint(self, obj: EngineProfile) -> str:
        """The hash whose change rolls the deployment's replicas."""
        return obj.fingerprint()


class ProfileIn(serializers.ModelSerializer):
    """An engine profile as written: args an argv list, env a map of strings."""

    class Meta:
        model = EngineProfile
        fields = [f for f in ProfileOut.Meta.fields if f not in ("id", "fingerprint", "created_at", "updated_at")]

    def validate_args(self, value):
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise serializers.ValidationError("args must be a list of strings (an argv list, never a shell string)")
        return value

    def validate_env(self, value):
        return _string_map(value, "env")

    def validate(self, attrs):
        def current(key: str) -> str:
            return attrs.get(key, getattr(self.instance, key, "")) or ""

        # llama-server's --alias splits on commas: the model would be served under other names.
        if current("engine") == Engine.LLAMACPP:
            for key in ("served_model_name", "name"):
                if current(key):
                    if "," in current(key):
                        raise serializers.ValidationError(
                            {key: "llama.cpp splits its served name on commas: choose a name without one"}
                        )
                    break
        return attrs


class DeploymentOut(serializers.ModelSerializer):
    """A deployment as read, with its replicas counted by state."""

    profile_name = serializers.CharField(source="profile.name", read_only=True)
    ready_replicas = serializers.IntegerField(read_only=True)
    live_replicas = serializers.IntegerField(read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "served_model",
            "profile",
            "profile_name",
            "replicas",
            "ready_replicas",
            "live_replicas",
            "pool",
            "node_selector",
            "policy",
            "paused",
            "created_at",
            "updated_at",
        ]


class DeploymentIn(serializers.ModelSerializer):
    """A deployment as written."""

    policy = serializers.ChoiceField(choices=[BINPACK, SPREAD], default=BINPACK)

    class Meta:
        model = Deployment
        fields = ["name", "served_model", "profile", "replicas", "pool", "node_selector", "policy", "paused"]

    def validate_node_selector(self, value):
        return _string_map(value, "node_selector")


class ScaleIn(serializers.Serializer):
    """How many replicas a deployment should have."""

    replicas = serializers.IntegerField(min_value=0, max_value=10_000)


class ScaleInErrors(serializers.Serializer):
    """400 from scale: what is wrong with the number of replicas."""

    replicas = serializers.ListField(child=serializers.CharField(), read_only=True)


class ShardOut(serializers.ModelSerializer):
    """A shard: where it runs and how it is."""

    deployment = serializers.IntegerField(source="replica.deployment_id", read_only=True)

    class Meta:
        model = Shard
        fields = [
            "id",
            "replica",
            "deployment",
            "node",
            "rank",
            "gpu_indices",
            "hcas",
            "http_port",
            "state",
            "reason",
            "exit_code",
            "profile_fp",
            "created_at",
            "updated_at",
        ]


class ReplicaShardOut(serializers.ModelSerializer):
    """A shard inside its replica."""

    class Meta:
        model = Shard
        fields = ["id", "node", "rank", "gpu_indices", "hcas", "http_port", "state", "reason"]


class ReplicaOut(serializers.ModelSerializer):
    """A replica with its shards and, while pending, the planner's reason node by node."""

    deployment_name = serializers.CharField(source="deployment.name", read_only=True)
    shards = ReplicaShardOut(many=True, read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "deployment",
            "deployment_name",
            "state",
            "reason",
            "pending_reasons",
            "nvlink_domain",
            "fabric",
            "fabric_name",
            "endpoint",
            "profile_fp",
            "replaces",
            "shards",
            "created_at",
            "updated_at",
            "ready_at",
        ]


class EventOut(serializers.ModelSerializer):
    """A placement event."""

    class Meta:
        model = PlacementEvent
        fields = [
            "id",
            "at",
            "deployment",
            "replica",
            "shard",
            "kind",
            "from_state",
            "to_state",
            "reason",
            "actor_name",
        ]


class HoldOut(serializers.ModelSerializer):
    """A hold as read."""

    created_by = serializers.CharField(source="created_by.username", default="", read_only=True)

    class Meta:
        model = Hold
        fields = ["id", "scope", "node", "label_key", "label_value", "fabric", "reason", "created_by", "created_at"]


class HoldIn(serializers.ModelSerializer):
    """A hold as written: it must name what it holds."""

    class Meta:
        model = Hold
        fields = ["scope", "node", "label_key", "label_value", "fabric", "reason"]

    def validate(self, attrs):
        scope = attrs.get("scope", getattr(self.instance, "scope", None))
        need = {"node": "node", "label": "label_key", "fabric": "fabric"}[scope]
        if not attrs.get(need, getattr(self.instance, need, None)):
            raise serializers.ValidationError({need: f"a {scope} hold must name its {need}"})
        return attrs


class PowerBudgetOut(serializers.ModelSerializer):
    """A power budget as read."""

    class Meta:
        model = PowerBudget
        fields = ["id", "label_key", "label_value", "budget_w", "created_at"]


class PowerBudgetIn(serializers.ModelSerializer):
    """A power budget as written."""

    class Meta:
        model = PowerBudget
        fields = ["label_key", "label_value", "budget_w"]


class DryRunIn(serializers.Serializer):
    """Where would this go now: a saved profile (or a deployment's) and optional overrides."""

    profile = serializers.PrimaryKeyRelatedField(queryset=EngineProfile.objects.all(), required=False)
    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all(), required=False)
    node_selector = serializers.DictField(child=serializers.CharField(), required=False)
    policy = serializers.ChoiceField(choices=[BINPACK, SPREAD], required=False)
    replicas = serializers.IntegerField(min_value=1, max_value=1000, default=1)

    def validate(self, attrs):
        if not attrs.get("profile") and not attrs.get("deployment"):
            raise serializers.ValidationError({"profile": "name a profile or a deployment"})
        return attrs


class PlannedShardOut(serializers.Serializer):
    """One shard of a dry-run plan: where it would run and what it would claim."""

    node = serializers.CharField(source="node_id")
    rank = serializers.IntegerField()
    gpu_indices = serializers.ListField(child=serializers.IntegerField())
    hcas = serializers.ListField(child=serializers.CharField())
    http_port = serializers.IntegerField()
    power_w = serializers.FloatField()
    install_engine = serializers.BooleanField()


class PlanOut(serializers.Serializer):
    """A replica's place or, with ok false, why it fits nowhere: `reason` only on a refusal,
    the place's fields only on a plan; `reasons` says why each other node was not chosen."""

    ok = serializers.BooleanField()
    reason = serializers.CharField(required=False)
    nvlink_domain = serializers.CharField(required=False)
    fabric = serializers.CharField(required=False)
    fabric_name = serializers.CharField(required=False)
    env = serializers.DictField(child=serializers.CharField(), required=False)
    shards = PlannedShardOut(many=True, required=False)
    reasons = serializers.DictField(child=serializers.CharField())


class DryRunOut(serializers.Serializer):
    """How many of the replicas asked for would be placed, and each one's plan (the first refusal last)."""

    placed = serializers.IntegerField()
    plans = PlanOut(many=True)
