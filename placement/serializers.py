"""Placement's API shapes: input validators apart from output serializers.

Every bound an input enforces is read from the wire schema (llmgw_wire/),
the one place the protocol's limits live: a profile, a deployment, a hold or
a budget the API accepts always becomes a StartShard the agent accepts, and
a value the database's checks would refuse is a 400 naming its field
instead of a 500.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from rest_framework import serializers

import llmgw_wire as wire
from llmgw.schema import field_errors
from llmgw_wire import engines as wire_engines
from placement import secrets
from placement.explain import EVERY_NODE, FITS_SHOWN, SUMMARY
from placement.models import (
    AutoscaleSample,
    Deployment,
    Engine,
    EngineProfile,
    Hold,
    PlacementEvent,
    PowerBudget,
    Replica,
    Shard,
    autoscale_problems,
)
from placement.planner import BINPACK, SPREAD

# A profile's power claim, per shard (W): more than any rack draws, less than a float's surprises.
MAX_POWER_W = 1_000_000.0
# A budget's power (W): a whole building's.
MAX_BUDGET_W = 1_000_000_000.0


@cache
def wire_rules(message: type[wire.Message], field: str) -> dict[str, Any]:
    """The JSON-schema rules the wire schema gives one field of a message (bounds, lengths, patterns)."""
    return message.model_json_schema()["properties"][field]


def wire_int(message: type[wire.Message], field: str, **kwargs: Any) -> serializers.IntegerField:
    """An integer input bounded exactly as the wire bounds the same field."""
    r = wire_rules(message, field)
    low = r.get("minimum", r["exclusiveMinimum"] + 1 if "exclusiveMinimum" in r else None)
    high = r.get("maximum", r["exclusiveMaximum"] - 1 if "exclusiveMaximum" in r else None)
    return serializers.IntegerField(min_value=int(low), max_value=int(high), **kwargs)


def wire_text(message: type[wire.Message], field: str, *, db_max: int | None = None, **kwargs: Any):
    """A string input no longer than the wire allows (nor its column, when narrower)."""
    limit = wire_rules(message, field)["maxLength"]
    if db_max is not None:
        limit = min(limit, db_max)
    return serializers.CharField(max_length=limit, allow_blank=True, trim_whitespace=False, **kwargs)


class WireMap(serializers.DictField):
    """A map of strings with the wire's bounds: entries, key length, key pattern, value length."""

    def __init__(self, *, entries: int, key_max: int, value_max: int, key_pattern: str | None = None, **kwargs):
        super().__init__(
            child=serializers.CharField(max_length=value_max, allow_blank=True, trim_whitespace=False), **kwargs
        )
        self.entries, self.key_max = entries, key_max
        self.key_pattern = re.compile(key_pattern) if key_pattern else None

    @classmethod
    def of(cls, message: type[wire.Message], field: str, **kwargs: Any) -> WireMap:
        """The map field bounded as `message.field` is on the wire."""
        r = wire_rules(message, field)
        pattern = next(iter(r.get("patternProperties", {})), None)
        value = r["patternProperties"][pattern] if pattern else r["additionalProperties"]
        return cls(
            entries=r["maxProperties"],
            key_max=r["propertyNames"]["maxLength"],
            value_max=value["maxLength"],
            key_pattern=pattern,
            **kwargs,
        )

    def to_internal_value(self, data: Any) -> dict:
        """The map, each key checked before its value."""
        if isinstance(data, dict):
            if len(data) > self.entries:
                raise serializers.ValidationError(f"at most {self.entries} entries")
            for k in data:
                if not isinstance(k, str) or not k or len(k) > self.key_max:
                    raise serializers.ValidationError(f"each key must be 1 to {self.key_max} characters")
                if self.key_pattern and not self.key_pattern.match(k):
                    raise serializers.ValidationError(f"key {k!r} must match {self.key_pattern.pattern}")
        return super().to_internal_value(data)


def wire_list(message: type[wire.Message], field: str, **kwargs: Any) -> serializers.ListField:
    """A list of strings bounded as the wire bounds it (items, and each item's length)."""
    r = wire_rules(message, field)
    child = serializers.CharField(max_length=r["items"]["maxLength"], allow_blank=True, trim_whitespace=False)
    return serializers.ListField(child=child, max_length=r["maxItems"], **kwargs)


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

    def to_representation(self, instance: EngineProfile) -> dict:
        """The profile with its secret env and flag values masked (placement/secrets.py)."""
        data = super().to_representation(instance)
        data["env"] = secrets.shown_env(data["env"])
        data["args"] = secrets.shown_args(data["args"])
        return data


class ProfileIn(serializers.ModelSerializer):
    """An engine profile as written: args an argv list, env a map of strings, each bounded as on the wire."""

    tp = wire_int(wire.EngineProfile, "tp", default=1)
    pp = wire_int(wire.EngineProfile, "pp", default=1)
    gpus_per_node = wire_int(wire.EngineProfile, "gpus_per_node", default=0)
    nodes = wire_int(wire.EngineProfile, "nodes", default=1)
    startup_timeout_s = wire_int(wire.StartShard, "startup_timeout_s", default=1800)
    power_w = serializers.FloatField(min_value=0, max_value=MAX_POWER_W, default=0.0)
    # An argv list, never a shell string.
    args = wire_list(wire.EngineProfile, "args", default=list)
    env = WireMap.of(wire.EngineProfile, "env", default=dict)
    engine_version = wire_text(wire.InstallEngine, "version", db_max=64, required=False)
    gpu_class = wire_text(wire.EngineProfile, "gpu_class", db_max=64, required=False)
    model_path = wire_text(wire.EngineProfile, "model_path", db_max=1024, required=False)
    served_model_name = wire_text(wire.EngineProfile, "served_model_name", db_max=128, required=False)

    class Meta:
        model = EngineProfile
        fields = [f for f in ProfileOut.Meta.fields if f not in ("id", "fingerprint", "created_at", "updated_at")]

    def to_internal_value(self, data: Any) -> dict:
        """Any name an engine goes by ("llama-server", "llama.cpp") is stored as its canonical one."""
        if type(data) is dict and isinstance(data.get("engine"), str) and wire_engines.canonical(data["engine"]):
            data = {**data, "engine": wire_engines.canonical(data["engine"])}
        return super().to_internal_value(data)

    def validate(self, attrs: dict) -> dict:
        """A secret sent back masked keeps its stored value (one masked with nothing stored is a 400);
        a served name llama.cpp would split is refused."""
        stored = self.instance
        for field, keep in (("env", secrets.kept_env), ("args", secrets.kept_args)):
            if field in attrs:
                try:
                    attrs[field] = keep(attrs[field], getattr(stored, field) if stored else None)
                except secrets.HiddenWithoutValue as e:
                    raise serializers.ValidationError({field: [str(e)]}) from None

        def current(key: str) -> str:
            return attrs.get(key, getattr(stored, key, "")) or ""

        def number(key: str, default: int) -> int:
            return attrs.get(key, getattr(stored, key, default))

        problems = wire_engines.parallelism_problems(
            current("engine"),
            tp=number("tp", 1),
            pp=number("pp", 1),
            nodes=number("nodes", 1),
            gpus_per_node=number("gpus_per_node", 0),
        )
        if problems:
            raise serializers.ValidationError(problems)

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


AUTOSCALE_FIELDS = (
    "autoscale_metric",
    "autoscale_min",
    "autoscale_max",
    "autoscale_target",
    "scale_up_window_s",
    "scale_down_window_s",
)
# A day of window at most: longer is a fixed deployment in disguise, and the history is kept a day.
AUTOSCALE_LIMITS = {
    "autoscale_min": {"max_value": 10_000},
    "autoscale_max": {"max_value": 10_000},
    "autoscale_target": {"min_value": 0.0, "max_value": 1e6},
    "scale_up_window_s": {"max_value": 86_400},
    "scale_down_window_s": {"max_value": 86_400},
}


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
            *AUTOSCALE_FIELDS,
            "created_at",
            "updated_at",
        ]


class AutoscaleChecks:
    """The policy's rule (models.autoscale_problems) over a partial write: a 400 naming the field."""

    def validate(self, attrs):
        attrs = super().validate(attrs)

        def current(key):
            if key in attrs:
                return attrs[key]
            if self.instance is not None:
                return getattr(self.instance, key)
            return Deployment._meta.get_field(key).get_default()

        problems = autoscale_problems(
            current("autoscale_metric"), current("autoscale_min"), current("autoscale_max"), current("autoscale_target")
        )
        if problems:
            raise serializers.ValidationError(problems)
        return attrs


class DeploymentIn(AutoscaleChecks, serializers.ModelSerializer):
    """A deployment as written; its node selector bounded as the wire bounds labels."""

    policy = serializers.ChoiceField(choices=[BINPACK, SPREAD], default=BINPACK)
    node_selector = WireMap.of(wire.Register, "labels", default=dict)
    pool = wire_text(wire.StartShard, "pool", db_max=64, required=False)
    served_model = serializers.CharField(max_length=wire_rules(wire.EngineProfile, "served_model_name")["maxLength"])

    class Meta:
        model = Deployment
        fields = [
            "name",
            "served_model",
            "profile",
            "replicas",
            "pool",
            "node_selector",
            "policy",
            "paused",
            *AUTOSCALE_FIELDS,
        ]
        extra_kwargs = {"replicas": {"max_value": 10_000}, **AUTOSCALE_LIMITS}


class AutoscaleIn(AutoscaleChecks, serializers.ModelSerializer):
    """A deployment's autoscaling policy as written (a partial write keeps the fields it leaves out)."""

    class Meta:
        model = Deployment
        fields = list(AUTOSCALE_FIELDS)
        extra_kwargs = AUTOSCALE_LIMITS


AutoscaleInErrors = field_errors(
    "AutoscaleInErrors",
    "400 from autoscale: what is wrong with the policy, field by field (only the fields with a problem appear).",
    AUTOSCALE_FIELDS,
)


class AutoscaleSampleOut(serializers.ModelSerializer):
    """One pass of the autoscaler over a deployment: what it saw and set."""

    class Meta:
        model = AutoscaleSample
        fields = ["at", "replicas", "desired", "recommended", "signal", "inflight", "held"]


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
            "output_tail",
            "profile_fp",
            "created_at",
            "updated_at",
        ]


class ReplicaShardOut(serializers.ModelSerializer):
    """A shard inside its replica."""

    class Meta:
        model = Shard
        fields = ["id", "node", "rank", "gpu_indices", "hcas", "http_port", "state", "reason", "output_tail"]


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
            "deployment_name",
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


def label_key(**kwargs: Any) -> serializers.RegexField:
    """A label key as the wire spells one (what selectors, holds and budgets match)."""
    return serializers.RegexField(wire.LABEL_KEY_PATTERN, max_length=wire.LABEL_MAX, **kwargs)


class HoldIn(serializers.ModelSerializer):
    """A hold as written: it must name what it holds."""

    label_key = label_key(required=False, allow_blank=True)
    label_value = serializers.CharField(max_length=wire.LABEL_MAX, required=False, allow_blank=True)
    fabric = wire_text(wire.StartShard, "fabric", db_max=128, required=False)
    reason = wire_text(wire.StopShard, "reason", required=False)

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

    label_key = label_key()
    label_value = serializers.CharField(max_length=wire.LABEL_MAX)
    budget_w = serializers.FloatField(min_value=0, max_value=MAX_BUDGET_W)

    class Meta:
        model = PowerBudget
        fields = ["label_key", "label_value", "budget_w"]


class DryRunIn(serializers.Serializer):
    """Where would this go now: a saved profile (or a deployment's) and optional overrides."""

    profile = serializers.PrimaryKeyRelatedField(queryset=EngineProfile.objects.all(), required=False)
    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all(), required=False)
    node_selector = WireMap.of(wire.Register, "labels", required=False)
    policy = serializers.ChoiceField(choices=[BINPACK, SPREAD], required=False)
    replicas = serializers.IntegerField(min_value=1, max_value=1000, default=1)
    explain = serializers.ChoiceField(
        choices=[SUMMARY, EVERY_NODE],
        default=SUMMARY,
        help_text="summary (default): each distinct reason with its node count and a few node names, and up to "
        f"{FITS_SHOWN} nodes that fit; all: also every node's reason",
    )

    def validate(self, attrs):
        if not attrs.get("profile") and not attrs.get("deployment"):
            raise serializers.ValidationError({"profile": "name a profile or a deployment"})
        return attrs


DryRunInErrors = field_errors(
    "DryRunInErrors",
    "400 from a dry run: what is wrong, field by field (only the fields with a problem appear).",
    ("profile", "deployment", "node_selector", "policy", "replicas", "explain"),
)


class ReasonCountOut(serializers.Serializer):
    """One reason the planner gave: for how many nodes, and the first few of them."""

    reason = serializers.CharField()
    nodes = serializers.IntegerField()
    examples = serializers.ListField(child=serializers.CharField())


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
    """A replica's place or, with ok false, why it fits nowhere: `reason` only on a refusal, the place's
    fields only on a plan; `summary` says why the other nodes were not chosen (each reason with its node
    count, commonest first), `fits` names some that could take it too, and `reasons` (only with explain
    "all") gives every other node's reason."""

    ok = serializers.BooleanField()
    reason = serializers.CharField(required=False)
    nvlink_domain = serializers.CharField(required=False)
    fabric = serializers.CharField(required=False)
    fabric_name = serializers.CharField(required=False)
    env = serializers.DictField(child=serializers.CharField(), required=False)
    shards = PlannedShardOut(many=True, required=False)
    summary = ReasonCountOut(many=True)
    fits = serializers.ListField(child=serializers.CharField())
    reasons = serializers.DictField(child=serializers.CharField(), required=False)


class DryRunOut(serializers.Serializer):
    """How many of the replicas asked for would be placed, and each one's plan (the first refusal last)."""

    placed = serializers.IntegerField()
    plans = PlanOut(many=True)
