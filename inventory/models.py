"""The control plane's view of the cluster: nodes, their hardware, and what holds it.

Durable facts live here; momentary telemetry (load, sensors, port counters)
lives in the cache (see inventory/telemetry.py), never a row per heartbeat.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from inventory import gpus as gpu_rules
from inventory import labels as label_rules


class NodeState(models.TextChoices):
    """Where a node stands. Only READY accepts new placement."""

    READY = "ready", "ready"
    # An operator excluded it from new placement; what runs there keeps running.
    CORDONED = "cordoned", "cordoned"
    # Its replicas are being moved off.
    DRAINING = "draining", "draining"
    # Heartbeats stopped but the node may come back.
    UNREACHABLE = "unreachable", "unreachable"
    # Unreachable long enough to declare its replicas dead.
    LOST = "lost", "lost"


# The moves a node may make. Operator states (cordoned, draining) are left only
# by an operator; a heartbeat brings unreachable and lost back to ready.
NODE_TRANSITIONS: dict[str, frozenset[str]] = {
    NodeState.READY: frozenset({NodeState.CORDONED, NodeState.DRAINING, NodeState.UNREACHABLE}),
    NodeState.CORDONED: frozenset({NodeState.READY, NodeState.DRAINING}),
    NodeState.DRAINING: frozenset({NodeState.READY, NodeState.CORDONED}),
    NodeState.UNREACHABLE: frozenset({NodeState.READY, NodeState.LOST, NodeState.CORDONED, NodeState.DRAINING}),
    NodeState.LOST: frozenset({NodeState.READY, NodeState.CORDONED, NodeState.DRAINING}),
}

OPERATOR_STATES = frozenset({NodeState.CORDONED, NodeState.DRAINING})


class Node(models.Model):
    """One machine in the cluster, as its agent last registered it."""

    id = models.CharField(primary_key=True, max_length=253)
    hostname = models.CharField(max_length=253, blank=True)
    mgmt_addr = models.CharField("management address", max_length=253, blank=True)
    # host:port of the agent's own Prometheus endpoint; "" when it serves none
    # or is too old to say (then Prometheus is not told to scrape it).
    metrics_addr = models.CharField("metrics address", max_length=253, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.READY, db_index=True)
    # Set while heartbeats are missing, whatever the state: a cordoned node keeps
    # its operator state but the operator still needs to see it is silent.
    unreachable_since = models.DateTimeField(null=True, blank=True)
    # Not indexed, on purpose: every lease writes it (2,000 a second at 10,000 nodes), and an index on
    # it made each renewal a new row version in every one of the table's seven indexes; without one the
    # renewal is a heap-only update (the table leaves room on its pages for it: migration 0008), at half
    # the database's CPU. The liveness sweep's few queries a pass scan the table instead (a few ms at
    # 10,000 nodes).
    last_seen = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    agent_version = models.CharField(max_length=128, blank=True)
    features = models.JSONField(default=list, blank=True)
    engine_versions = models.JSONField(default=dict, blank=True)
    # engine_versions is an answer: empty then means "has none", not "too old to say".
    engines_probed = models.BooleanField(default=False)
    os_id = models.CharField(max_length=128, blank=True)
    os_version = models.CharField(max_length=128, blank=True)
    os_codename = models.CharField(max_length=128, blank=True)
    arch = models.CharField(max_length=64, blank=True)
    cpu_flags = models.JSONField(default=list, blank=True)
    nvidia_driver = models.CharField(max_length=64, blank=True)
    # Zero is "not reported", which constrains nothing.
    memory_total_mb = models.BigIntegerField(default=0)
    cpu_count = models.IntegerField(default=0)
    # The agent's labels (agent.yaml) and the operator's, kept apart so that an
    # operator label removed brings the agent's value back; `labels` is the
    # effective result, stored for filtering.
    agent_labels = models.JSONField(default=dict, blank=True)
    operator_labels = models.JSONField(default=dict, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    imex_state = models.CharField("IMEX state", max_length=64, blank=True)
    imex_channels = models.IntegerField("IMEX channels", default=0)
    # The multi-node NVLink domain every card is joined to, "" for none.
    nvlink_domain = models.CharField("NVLink domain", max_length=160, blank=True, db_index=True)
    # Whether storage and weights were reported at all (None on the wire).
    storage_reported = models.BooleanField(default=False)
    weights_reported = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        # The operator's acts, apart from "change": the inventory itself is the
        # agent's report, so no one edits a node's row by hand.
        permissions = [
            ("cordon_node", "Can cordon and uncordon a node"),
            ("drain_node", "Can drain a node"),
            ("change_labels", "Can change a node's operator labels"),
            ("forget_node", "Can forget a node"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=NodeState.values), name="inventory_node_state_valid"),
            models.CheckConstraint(condition=Q(memory_total_mb__gte=0), name="inventory_node_memory_nonnegative"),
            models.CheckConstraint(condition=Q(cpu_count__gte=0), name="inventory_node_cpus_nonnegative"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def schedulable(self) -> bool:
        """Whether new replicas may be placed here: only a ready node."""
        return self.state == NodeState.READY

    @property
    def reachable(self) -> bool:
        """Whether the node's heartbeats are arriving."""
        return self.unreachable_since is None and self.state not in (NodeState.UNREACHABLE, NodeState.LOST)

    def effective_labels(self) -> dict[str, str]:
        """The labels placement matches: the agent's, overlaid by the operator's."""
        return label_rules.merge(self.agent_labels, self.operator_labels)

    def imex_up(self) -> bool:
        """Whether nvidia-imex reports itself up on this node."""
        return gpu_rules.imex_up(self.imex_state)


class GPU(models.Model):
    """One GPU of a node."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField("UUID", max_length=128, blank=True, db_index=True)
    name = models.CharField(max_length=128, blank=True)
    gpu_class = models.CharField("class", max_length=64, blank=True, db_index=True)
    memory_total_mb = models.IntegerField(default=0)
    memory_used_mb = models.IntegerField(default=0)
    compute_capability = models.CharField(max_length=16, blank=True)
    numa_node = models.IntegerField("NUMA node", default=-1)
    pci_bus_id = models.CharField("PCI bus id", max_length=64, blank=True)
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField("CUDA version", max_length=64, blank=True)
    utilization_percent = models.IntegerField(default=0)
    nvlink_peers = models.JSONField("NVLink peers", default=list, blank=True)
    nic_paths = models.JSONField("NIC paths", default=dict, blank=True)
    # NVLink fabric, "" state when the driver reported none.
    fabric_state = models.CharField(max_length=64, blank=True)
    fabric_status = models.CharField(max_length=64, blank=True)
    cluster_uuid = models.CharField("cluster UUID", max_length=128, blank=True)
    clique_id = models.CharField(max_length=64, blank=True)
    fabric_bandwidth = models.CharField(max_length=64, blank=True)
    # The driver's health summary of the card's fabric ("" not reported): a
    # joined card that says Unhealthy keeps its node out of the domain.
    fabric_health = models.CharField(max_length=64, blank=True)
    ecc_errors = models.IntegerField("ECC errors", default=0)
    temperature_c = models.IntegerField(default=0)
    problems = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["node_id", "index"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="inventory_gpu_index_unique_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}/gpu{self.index}"

    @property
    def healthy(self) -> bool:
        """A card with an ECC fault or a reported problem (a foreign process) is not usable."""
        return gpu_rules.healthy(self.ecc_errors, self.problems)

    @property
    def nvlink_domain(self) -> str:
        """The multi-node NVLink domain this card is joined to, "" for none."""
        return gpu_rules.gpu_domain(self.fabric_state, self.fabric_status, self.cluster_uuid, self.clique_id)


class FabricAttachment(models.Model):
    """A node's declared connection to one fabric (agent.yaml: name, hcas, rate_gbps)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="fabrics")
    # The operator's name. Never derived from a GID prefix: OpenSM's default
    # fe80:: is on every fabric, so a matching prefix proves nothing.
    name = models.CharField(max_length=63, db_index=True)
    hcas = models.JSONField("HCAs", default=list, blank=True)
    # The slowest active port's rate: a collective runs at its slowest link.
    rate_gbps = models.IntegerField("rate (Gb/s)", default=0)

    class Meta:
        ordering = ["node_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["node", "name"], name="inventory_fabric_unique_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.name}"


class Storage(models.Model):
    """One filesystem holding a node's model directories."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="storage")
    path = models.CharField(max_length=1024)
    free_bytes = models.BigIntegerField(default=0)
    total_bytes = models.BigIntegerField(default=0)
    # A filer mounted by many nodes: its space belongs to everyone.
    shared = models.BooleanField(default=False)
    fstype = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["node_id", "path"]
        verbose_name_plural = "storage"
        constraints = [models.UniqueConstraint(fields=["node", "path"], name="inventory_storage_unique_per_node")]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.path}"


class LocalWeights(models.Model):
    """Model files a node can see, however they got there."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="weights")
    path = models.CharField(max_length=1024)
    size_bytes = models.BigIntegerField(default=0)
    shared = models.BooleanField(default=False)

    class Meta:
        ordering = ["node_id", "path"]
        verbose_name_plural = "local weights"
        constraints = [models.UniqueConstraint(fields=["node", "path"], name="inventory_weights_unique_per_node")]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.path}"


class EngineInstallState(models.TextChoices):
    """Where installing an engine stands on a node."""

    INSTALLING = "installing"
    READY = "ready"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"


class EngineInstall(models.Model):
    """One engine's installation on a node."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="engine_installs")
    engine = models.CharField(max_length=64)
    version = models.CharField(max_length=128, blank=True)
    variant = models.CharField(max_length=128, blank=True)
    state = models.CharField(max_length=16, choices=EngineInstallState.choices)
    detail = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node_id", "engine"]
        constraints = [
            models.UniqueConstraint(fields=["node", "engine"], name="inventory_engine_install_unique_per_node"),
            models.CheckConstraint(
                condition=Q(state__in=EngineInstallState.values), name="inventory_engine_install_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.engine} {self.version} ({self.state})"


class Allocation(models.Model):
    """One shard's claim on a node: GPUs (as AllocatedGPU rows), host memory, cores and power.

    Claimed memory is counted, not compared against the total each time:
    otherwise two models each declaring most of a machine are both placed
    there, and the second is what the kernel kills.
    """

    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    replica_id = models.UUIDField(db_index=True)
    shard_id = models.UUIDField(unique=True)
    # Zero for a profile that declared nothing: constrains and counts nothing.
    memory_gb = models.IntegerField(default=0)
    # Cores for a shard with no GPU; zero shares whatever is free.
    cpu_cores = models.IntegerField(default=0)
    # Declared or derived draw, counted against power budgets.
    power_w = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["node_id", "created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(memory_gb__gte=0), name="inventory_allocation_memory_nonnegative"),
            models.CheckConstraint(condition=Q(cpu_cores__gte=0), name="inventory_allocation_cores_nonnegative"),
            models.CheckConstraint(condition=Q(power_w__gte=0), name="inventory_allocation_power_nonnegative"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}: shard {self.shard_id}"

    @property
    def gpu_indices(self) -> list[int]:
        """The GPU indices this allocation holds, sorted."""
        return sorted(g.gpu_index for g in self.gpus.all())


class AllocatedGPU(models.Model):
    """One GPU held by one allocation. The unique constraint is the rule that a GPU
    is held by one shard at a time: two reconcilers racing cannot both win."""

    allocation = models.ForeignKey(Allocation, on_delete=models.CASCADE, related_name="gpus")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocated_gpus")
    gpu_index = models.PositiveSmallIntegerField()

    class Meta:
        verbose_name = "allocated GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "gpu_index"], name="inventory_gpu_held_by_one_shard"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}/gpu{self.gpu_index}"


class SMChange(models.Model):
    """A port seeing a different master subnet manager than before: a failover is
    the fabric's own event, and nothing else remembers it once the ports agree again."""

    at = models.DateTimeField(db_index=True)
    node_id = models.CharField(max_length=253)
    port = models.CharField(max_length=128)
    from_guid = models.CharField(max_length=64, blank=True)
    to_guid = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name = "SM change"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.node_id} {self.port}: {self.from_guid} -> {self.to_guid}"


class FabricScan(models.Model):
    """The latest ibnetdiscover of one physical fabric: its text, and who ran it when."""

    key = models.CharField(max_length=128, unique=True)
    at = models.DateTimeField()
    node_id = models.CharField(max_length=253, blank=True)
    port = models.CharField(max_length=128, blank=True)
    output = models.TextField(blank=True)
    # Set when the latest try failed; output then still holds the last good map.
    error = models.TextField(blank=True)
    took_s = models.FloatField(default=0.0)
    # When `output` was read, which is older than `at` after a failed try.
    output_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return self.key


class NodeEvent(models.Model):
    """Something that happened to a node, with who did it: the audit trail and the "why".

    A forgotten node's events stay, naming it in `node_name`: the history of a
    machine gone for good is what an incident review reads.
    """

    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    # The node's id, written with every event: `node` goes null when the node is forgotten, this stays.
    node_name = models.CharField(max_length=253)
    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=32, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # "agent", "system" or the operator's username at the time, kept if the user is deleted.
    actor_name = models.CharField(max_length=150, blank=True)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["node", "-at"], name="inventory_event_node_at")]
        constraints = [
            # An event always says which node it is about, before and after the node is forgotten.
            models.CheckConstraint(condition=~Q(node_name=""), name="inventory_nodeevent_names_its_node"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.node_label} {self.kind}: {self.message}"

    @property
    def node_label(self) -> str:
        """The node's id, also once it is forgotten."""
        return self.node_name or self.node_id or ""


class LivenessClock(models.Model):
    """What the liveness sweep knows of its own health: one row (id 1).

    A node is judged only on silence the control plane could have heard: a
    gap between two sweeps (the database was down, or beat was) and a mass
    silence of the fleet are windows in which the control plane itself was
    deaf, so they are not held against any node.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    last_sweep_at = models.DateTimeField(null=True, blank=True)
    # The last window in which the control plane could not hear heartbeats.
    blind_from = models.DateTimeField(null=True, blank=True)
    blind_until = models.DateTimeField(null=True, blank=True)
    blind_reason = models.TextField(blank=True)
    # Set while most of the fleet is silent at once (treated as the control plane's own fault).
    disruption_since = models.DateTimeField(null=True, blank=True)
    disruption_detail = models.TextField(blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="inventory_liveness_clock_singleton")]

    def __str__(self) -> str:
        return f"liveness clock (last sweep {self.last_sweep_at})"


class ControlPlaneEvent(models.Model):
    """Something the control plane noticed about itself: a blind sweep, a mass silence starting or ending."""

    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=32)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind}: {self.message}"


class CommandKind(models.TextChoices):
    """The commands an agent answers (wire)."""

    START_SHARD = "start_shard"
    STOP_SHARD = "stop_shard"
    SCAN_FABRIC = "scan_fabric"
    INSTALL_ENGINE = "install_engine"


class Command(models.Model):
    """A command for one node, delivered in heartbeat answers until the agent acknowledges it.

    Delivered until acknowledged and never run twice: the agent applies
    commands idempotently by id, and an acknowledged command is never sent again.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey("inventory.Node", on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=32, choices=CommandKind.choices)
    # The wire message (wire.StartShard etc.) without its id.
    payload = models.JSONField()
    created_at = models.DateTimeField(db_index=True)
    # First and latest delivery in a heartbeat answer, and how often.
    first_delivered_at = models.DateTimeField(null=True, blank=True)
    deliveries = models.IntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)
    # What the command is about, for cancelling what is no longer wanted
    # (a StartShard for a replica since released).
    shard_id = models.CharField(max_length=64, blank=True, db_index=True)

    class Meta:
        # The table keeps the name it had under agents (moved without copying rows).
        db_table = "agents_command"
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["node", "created_at"], name="agents_cmd_pending", condition=Q(acked_at__isnull=True)),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=CommandKind.values), name="agents_command_kind_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.id} for {self.node_id}"
