"""What should run (profiles, deployments), what does (replicas, shards), and the
facility's rules for where (holds, power budgets)."""

from __future__ import annotations

import hashlib
import json
import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q

from llmgw_wire import ShardState as WireShardState
from llmgw_wire import engines as wire_engines
from llmgw_wire import shard_states
from placement.bounds import MAX_POWER_W, MAX_REPLICAS, JSONShape, validate_args, validate_env, validate_power


class Engine(models.TextChoices):
    """The inference engines an agent can start."""

    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    LLAMACPP = "llamacpp", "llama.cpp"
    ECHO = "echo", "echo (test engine)"


class EngineProfile(models.Model):
    """How to run a model: engine, parallelism, what it claims of a node, its arguments."""

    name = models.CharField(max_length=128, unique=True)
    engine = models.CharField(max_length=16, choices=Engine.choices)
    engine_version = models.CharField(max_length=64, blank=True)
    gpu_class = models.CharField("GPU class", max_length=64, blank=True)
    tp = models.PositiveIntegerField("tensor parallel", default=1, validators=[MinValueValidator(1)])
    pp = models.PositiveIntegerField("pipeline parallel", default=1, validators=[MinValueValidator(1)])
    gpus_per_node = models.PositiveIntegerField("GPUs per node", default=0)
    nodes = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    memory_gb = models.PositiveIntegerField("host memory (GB)", default=0)
    cpu_cores = models.PositiveIntegerField(default=0)
    # 0: derive from the node's cards and cores.
    power_w = models.FloatField("power (W)", default=0.0, validators=[validate_power])
    args = models.JSONField(default=list, blank=True, validators=[validate_args])
    env = models.JSONField(default=dict, blank=True, validators=[validate_env])
    model_path = models.CharField(max_length=1024, blank=True)
    # Local disk a node needs to fetch the weights when they are not there (GB); 0 constrains nothing.
    disk_gb = models.PositiveIntegerField("local disk for weights (GB)", default=0)
    served_model_name = models.CharField(max_length=128, blank=True)
    startup_timeout_s = models.PositiveIntegerField(default=1800)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(engine__in=Engine.values), name="placement_profile_engine_valid"),
            models.CheckConstraint(
                condition=Q(tp__gte=1) & Q(pp__gte=1) & Q(nodes__gte=1), name="placement_profile_parallelism_positive"
            ),
            # NaN and infinities fail it too: PostgreSQL orders NaN above every number.
            models.CheckConstraint(
                condition=Q(power_w__gte=0) & Q(power_w__lte=MAX_POWER_W), name="placement_profile_power_bounded"
            ),
            models.CheckConstraint(condition=JSONShape("args", "strings"), name="placement_profile_args_strings"),
            models.CheckConstraint(condition=JSONShape("env", "string_map"), name="placement_profile_env_strings"),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse parallelism the engine cannot run (the admin's form and the API ask the same rule)."""
        problems = wire_engines.parallelism_problems(
            self.engine, tp=self.tp or 1, pp=self.pp or 1, nodes=self.nodes or 1, gpus_per_node=self.gpus_per_node or 0
        )
        if problems:
            raise ValidationError(problems)

    def fingerprint(self) -> str:
        """A hash of everything that changes what a shard runs; a change rolls the replicas."""
        data = {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "gpu_class": self.gpu_class,
            "tp": self.tp,
            "pp": self.pp,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "args": self.args,
            "env": self.env,
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class Policy(models.TextChoices):
    """How replicas are spread over nodes."""

    BINPACK = "binpack", "binpack (fill the fullest nodes first)"
    SPREAD = "spread", "spread (the emptiest nodes first)"


class AutoscaleMetric(models.TextChoices):
    """What an autoscaled deployment's replica count follows ("" : not autoscaled)."""

    OFF = "", "off (a fixed number of replicas)"
    INFLIGHT = "inflight", "requests in flight per replica"
    QUEUE = "queue", "requests waiting at the engine per replica"
    TTFT_P95 = "ttft_p95", "time to first token, p95 (seconds)"


class Deployment(models.Model):
    """What an operator wants running: a served model, how many replicas, and where.

    With an autoscaling metric, `replicas` is set by the reconciler between
    `autoscale_min` and `autoscale_max` (placement/autoscale.py); without
    one it is the operator's number.
    """

    name = models.CharField(max_length=128, unique=True)
    served_model = models.CharField(max_length=128)
    profile = models.ForeignKey(EngineProfile, on_delete=models.PROTECT, related_name="deployments")
    replicas = models.PositiveIntegerField("desired replicas", default=1, validators=[MaxValueValidator(MAX_REPLICAS)])
    pool = models.CharField(max_length=64, blank=True)
    node_selector = models.JSONField(default=dict, blank=True)
    policy = models.CharField(max_length=16, choices=Policy.choices, default=Policy.BINPACK)
    paused = models.BooleanField(default=False)
    autoscale_metric = models.CharField(
        "autoscaling metric", max_length=16, choices=AutoscaleMetric.choices, default=AutoscaleMetric.OFF, blank=True
    )
    autoscale_min = models.PositiveIntegerField(
        "minimum replicas", default=1, validators=[MaxValueValidator(MAX_REPLICAS)]
    )
    autoscale_max = models.PositiveIntegerField(
        "maximum replicas", default=1, validators=[MaxValueValidator(MAX_REPLICAS)]
    )
    # Per replica for inflight and queue; seconds for ttft_p95.
    autoscale_target = models.FloatField("target value", default=0.0)
    # The load must stay high this long before a scale-up (0: at once), and low
    # this long before a scale-down (the HPA's stabilisation windows).
    scale_up_window_s = models.PositiveIntegerField("scale-up window (s)", default=0)
    scale_down_window_s = models.PositiveIntegerField("scale-down window (s)", default=300)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(policy__in=Policy.values), name="placement_deployment_policy_valid"),
            models.CheckConstraint(
                condition=Q(replicas__gte=0) & Q(replicas__lte=MAX_REPLICAS),
                name="placement_deployment_replicas_bounded",
            ),
            models.CheckConstraint(
                condition=Q(autoscale_metric__in=AutoscaleMetric.values),
                name="placement_deployment_autoscale_metric_valid",
            ),
            # The bounds are within the replica bound whether autoscaling is on or not: a policy
            # turned on later starts from what was stored.
            models.CheckConstraint(
                condition=Q(autoscale_min__gte=0) & Q(autoscale_min__lte=MAX_REPLICAS),
                name="placement_deployment_autoscale_min_bounded",
            ),
            models.CheckConstraint(
                condition=Q(autoscale_max__gte=0) & Q(autoscale_max__lte=MAX_REPLICAS),
                name="placement_deployment_autoscale_max_bounded",
            ),
            models.CheckConstraint(
                condition=Q(autoscale_metric="") | (Q(autoscale_max__gte=F("autoscale_min")) & Q(autoscale_max__gte=1)),
                name="placement_deployment_autoscale_bounds",
            ),
            models.CheckConstraint(
                condition=Q(autoscale_metric="") | Q(autoscale_target__gt=0),
                name="placement_deployment_autoscale_target_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def autoscaled(self) -> bool:
        """Whether the reconciler sets the replica count."""
        return bool(self.autoscale_metric)

    def clean(self) -> None:
        """Refuse an autoscaling policy that cannot hold (the admin's form and the API ask the same rule)."""
        problems = autoscale_problems(
            self.autoscale_metric, self.autoscale_min or 0, self.autoscale_max or 0, self.autoscale_target or 0.0
        )
        if problems:
            raise ValidationError(problems)


def autoscale_problems(metric: str, minimum: int, maximum: int, target: float) -> dict[str, str]:
    """What is wrong with an autoscaling policy, by field ("" metric: off, nothing to check)."""
    if not metric:
        return {}
    out = {}
    if maximum < 1:
        out["autoscale_max"] = "at least 1: a deployment that may never run a replica serves nothing"
    elif maximum < minimum:
        out["autoscale_max"] = f"must not be below the minimum ({minimum})"
    if not target > 0:
        out["autoscale_target"] = "must be above 0 when autoscaling"
    return out


class ReplicaState(models.TextChoices):
    """Where a replica stands."""

    PENDING = "pending"
    PLACING = "placing"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


REPLICA_TRANSITIONS: dict[str, frozenset[str]] = {
    ReplicaState.PENDING: frozenset(
        {ReplicaState.PLACING, ReplicaState.STARTING, ReplicaState.STOPPED, ReplicaState.FAILED}
    ),
    ReplicaState.PLACING: frozenset(
        {ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.STOPPED, ReplicaState.FAILED}
    ),
    ReplicaState.STARTING: frozenset(
        {ReplicaState.READY, ReplicaState.FAILED, ReplicaState.DRAINING, ReplicaState.STOPPED, ReplicaState.DEGRADED}
    ),
    ReplicaState.READY: frozenset(
        {ReplicaState.DEGRADED, ReplicaState.DRAINING, ReplicaState.FAILED, ReplicaState.STOPPED}
    ),
    ReplicaState.DEGRADED: frozenset(
        {ReplicaState.READY, ReplicaState.FAILED, ReplicaState.DRAINING, ReplicaState.STOPPED}
    ),
    ReplicaState.DRAINING: frozenset({ReplicaState.STOPPED, ReplicaState.FAILED}),
    ReplicaState.STOPPED: frozenset(),
    ReplicaState.FAILED: frozenset({ReplicaState.STOPPED}),
}


class Replica(models.Model):
    """One running copy of a deployment, made of one shard per node it spans."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    state = models.CharField(max_length=16, choices=ReplicaState.choices, default=ReplicaState.PENDING, db_index=True)
    # Why it is in that state: the planner's explanation while pending.
    reason = models.TextField(blank=True)
    # The planner's reason node by node while pending (node id -> reason).
    pending_reasons = models.JSONField(default=dict, blank=True)
    nvlink_domain = models.CharField(max_length=160, blank=True)
    # The physical fabric key (sm:..., roce:...) and the declared name it maps onto.
    fabric = models.CharField(max_length=128, blank=True)
    fabric_name = models.CharField(max_length=63, blank=True)
    endpoint = models.CharField(max_length=256, blank=True)
    profile_fp = models.CharField("profile fingerprint", max_length=32, blank=True)
    # The replica this one replaces (drain, profile roll): the old one stops
    # once this one is ready, so capacity never dips.
    replaces = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replaced_by")
    created_at = models.DateTimeField(db_index=True)
    updated_at = models.DateTimeField()
    ready_at = models.DateTimeField(null=True, blank=True)
    # When a retiring replica's shards were told to stop: a serving replica
    # drains its requests first (placement.retiring.stop_when_idle).
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    # A pending replica is not placed before this (a backoff after failed starts or a failed placement).
    not_before = models.DateTimeField(null=True, blank=True)
    # Placements of this replica that raised; each doubles its wait.
    attempts = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["deployment_id", "created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=ReplicaState.values), name="placement_replica_state_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id}/{str(self.id)[:8]}"


ShardState = models.TextChoices("ShardState", [(s.name, s.value) for s in WireShardState])


class Shard(models.Model):
    """One process of a replica on one node: its GPUs, adapters, port and state."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="shards")
    node = models.ForeignKey("inventory.Node", on_delete=models.PROTECT, related_name="shards")
    rank = models.PositiveIntegerField(default=0)
    gpu_indices = models.JSONField(default=list, blank=True)
    hcas = models.JSONField("HCAs", default=list, blank=True)
    http_port = models.PositiveIntegerField()
    # Ports the engine binds right after http_port (SGLang's data-parallel attention), reserved with it.
    ports_after = models.PositiveSmallIntegerField(default=0)
    # The rank-0 shard's rendezvous port (vLLM's --master-port, SGLang's --dist-init-addr): stored, so
    # a reload of the placement index cannot hand it to another shard ("address already in use").
    rendezvous_port = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=ShardState.choices, default="pending", db_index=True)
    reason = models.TextField(blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # The end of the engine's output when the shard failed, as its agent reported it,
    # redacted and bounded again here (wire.bounded_tail): why, in the engine's words.
    output_tail = models.TextField(blank=True, help_text="A failed shard's last lines of engine output, redacted.")
    # Failed before any engine ran because its agent found this port taken on the node: a fact about
    # the node (the replica is placed again on another port), not a failed start of the deployment.
    port_in_use = models.PositiveIntegerField(
        null=True, blank=True, help_text="The port the agent found taken when the shard was to start."
    )
    profile_fp = models.CharField("profile fingerprint", max_length=32, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["replica_id", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "rank"], name="placement_shard_rank_unique"),
            # One live shard per port on a node, as one per GPU: two racing placements
            # that picked the same free port cannot both commit.
            models.UniqueConstraint(
                fields=["node", "http_port"],
                condition=~Q(state__in=sorted(shard_states.TERMINAL)),
                name="placement_shard_live_port_unique",
            ),
            models.UniqueConstraint(
                fields=["node", "rendezvous_port"],
                condition=~Q(state__in=sorted(shard_states.TERMINAL)) & Q(rendezvous_port__isnull=False),
                name="placement_shard_live_rendezvous_port_unique",
            ),
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in WireShardState]), name="placement_shard_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.replica_id}/{self.rank}@{self.node_id}"


class PlacementEvent(models.Model):
    """A replica's or shard's change of state, with time and reason: the "why" an operator reads."""

    at = models.DateTimeField(db_index=True)
    # History outlives its subject: deleting a deployment (and with it its
    # replicas) keeps their events, which then name it by deployment_name.
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    deployment_name = models.CharField(max_length=128, blank=True)
    replica = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    shard = models.ForeignKey(Shard, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    kind = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16, blank=True)
    reason = models.TextField(blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind} {self.from_state}->{self.to_state}: {self.reason}"


class AutoscaleSample(models.Model):
    """What the autoscaler saw and recommended for one deployment in one reconcile pass.

    The recommendations of the last window are the stabilisation history (a
    scale-down needs every one of them to agree); the rows also draw the
    deployment's chart of replicas and signal. Pruned after a day.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="autoscale_samples")
    at = models.DateTimeField()
    # Replicas counted (not retiring) when the pass looked, and what it set.
    replicas = models.PositiveIntegerField()
    desired = models.PositiveIntegerField()
    # What the load alone asks for, before the windows and the bounds.
    recommended = models.PositiveIntegerField()
    # The metric's value (None: nothing measured), and the requests in flight and held.
    signal = models.FloatField(null=True, blank=True)
    inflight = models.PositiveIntegerField(default=0)
    held = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["deployment_id", "at"]
        indexes = [models.Index(fields=["deployment", "at"], name="placement_autoscale_dep_at")]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.at:%H:%M:%S} {self.replicas} -> {self.desired}"


class AvoidanceClear(models.Model):
    """An operator cleared a deployment's avoidance of a node: its failed starts there before `at` no longer count.

    One row per deployment and node, moved forward by each clear; each clear is
    also a PlacementEvent ("avoidance_cleared") naming who, when and the node.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="avoidance_clears")
    node = models.ForeignKey("inventory.Node", on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField()
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["deployment_id", "node_id"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "node"], name="placement_avoidance_clear_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} on {self.node_id} cleared {self.at:%Y-%m-%d %H:%M:%S}"


class HoldScope(models.TextChoices):
    """What a hold applies to."""

    NODE = "node"
    LABEL = "label"
    FABRIC = "fabric"


class Hold(models.Model):
    """Nothing new is placed on what a hold names: a node, a label value (a rack), or a fabric."""

    scope = models.CharField(max_length=16, choices=HoldScope.choices)
    node = models.ForeignKey("inventory.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="holds")
    label_key = models.CharField(max_length=63, blank=True)
    label_value = models.CharField(max_length=63, blank=True)
    fabric = models.CharField(max_length=128, blank=True)
    reason = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["scope", "id"]
        constraints = [
            models.CheckConstraint(
                condition=(Q(scope="node") & Q(node__isnull=False))
                | (Q(scope="label") & ~Q(label_key=""))
                | (Q(scope="fabric") & ~Q(fabric="")),
                name="placement_hold_names_its_target",
            ),
        ]

    def __str__(self) -> str:
        if self.scope == HoldScope.NODE:
            return f"hold node {self.node_id}"
        if self.scope == HoldScope.LABEL:
            return f"hold {self.label_key}={self.label_value}"
        return f"hold fabric {self.fabric}"


class PowerBudget(models.Model):
    """A power budget for the nodes carrying one label value (a rack, a PDU, a room)."""

    label_key = models.CharField(max_length=63)
    label_value = models.CharField(max_length=63)
    budget_w = models.FloatField("budget (W)", validators=[MinValueValidator(0)])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["label_key", "label_value"]
        constraints = [
            models.UniqueConstraint(fields=["label_key", "label_value"], name="placement_power_budget_unique"),
            models.CheckConstraint(condition=Q(budget_w__gte=0), name="placement_power_budget_nonnegative"),
        ]

    def __str__(self) -> str:
        return f"{self.label_key}={self.label_value}: {self.budget_w / 1000:.1f} kW"
