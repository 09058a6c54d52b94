"""The agent protocol's wire schema: the single source of truth for every message.

Imported by the control plane and by the node agent, so it imports no Django.
Every field an older agent may not send is optional and defaults to None,
which means "not reported", never zero: a registration without memory is an
agent too old to say, not a machine without RAM.

Every list and string is bounded, so a malformed or hostile body is refused
with a field path (pydantic's error locations) before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

API_VERSION = "v1"

# Bounds. Generous for real hardware (a GB200 tray has 4 GPUs, an HGX 8, a
# future box 16), tight enough that a body cannot exhaust the server.
MAX_GPUS = 64
MAX_PORTS = 64
MAX_SHARDS = 256
MAX_LABELS = 64
MAX_LIST = 256
MAX_COMMANDS = 256
# The InfiniBand port error counters watched, by their sysfs names: the doctor
# judges them, the agent exports them. A rising link_downed is a link that
# flapped; the others are a bad cable or port getting worse.
IB_ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
MAX_SCAN_TEXT = 8 * 1024 * 1024

Name = Annotated[str, StringConstraints(max_length=253)]
Short = Annotated[str, StringConstraints(max_length=128)]
Text = Annotated[str, StringConstraints(max_length=4096)]
# A label key: what placement selectors match, for the agent's labels and the operator's alike.
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"
LABEL_MAX = 63
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=LABEL_MAX, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=LABEL_MAX)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS)]
NodeId = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
]
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
# host:port, [v6]:port: handed to Prometheus as a scrape target, so nothing else (no scheme, path or query).
MetricsAddr = Annotated[
    str,
    StringConstraints(
        max_length=253, pattern=r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"
    ),
]
SmallInt = Annotated[int, Field(ge=0, le=1_000_000)]
GPUIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS)]
Port = Annotated[int, Field(ge=1, le=65535)]
# Wear counters: -1 is "not reported for this card" (a card before Ampere has
# no remapped rows, one after no retired pages).
WearCount = Annotated[int, Field(ge=-1, le=2**53)]


# Secrets in a profile, decided by name on both ends of the wire: the agent
# masks them in shard logs, the control plane shows them to nobody. A flag or
# an environment variable whose name ends in one of these words carries one
# (`--api-key`, `--hf-token`, `--db-password`, HF_TOKEN, OPENAI_API_KEY).
# "tokens" is not one: it counts tokens in every engine's flags
# (`--max-num-batched-tokens`), and nor is `--tokenizer` or `--ssl-keyfile`.
_SECRET_WORD = r"(key|token|secret|password|passwd)"
SECRET_FLAG = re.compile(rf"^--?[\w-]*?{_SECRET_WORD}$", re.I)
SECRET_ENV = re.compile(rf"^\w*?{_SECRET_WORD}$", re.I)
MASK = "***"


def mask_args(argv: Iterable[str]) -> list[str]:
    """`argv` with the value of each secret-carrying flag masked (`--api-key X` and `--api-key=X` alike)."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if SECRET_FLAG.match(flag):
            out.append(f"{flag}={MASK}" if eq else arg)
            mask_next = not eq
        else:
            out.append(arg)
    return out


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the value of each secret-named variable masked."""
    return {k: (MASK if SECRET_ENV.match(k) else v) for k, v in env.items()}


def masked_command(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A queued command's payload for showing: a StartShard's profile env and args masked."""
    out = dict(payload)
    profile = out.get("profile")
    if isinstance(profile, Mapping):
        profile = dict(profile)
        if isinstance(profile.get("env"), Mapping):
            profile["env"] = mask_env(profile["env"])
        if isinstance(profile.get("args"), list):
            profile["args"] = mask_args(profile["args"])
        out["profile"] = profile
    return out


def empty_list() -> Any:
    """An empty list as a field's default, without a copy per message.

    pydantic deep-copies a mutable default (`= []`) for every message that
    omits the field; a factory builds a fresh one for less. The JSON schema
    still says the default is [].
    """
    return Field(default_factory=list, json_schema_extra={"default": []})


def empty_dict() -> Any:
    """An empty dict as a field's default (see empty_list)."""
    return Field(default_factory=dict, json_schema_extra={"default": {}})


class Message(BaseModel):
    """Base of every wire message: fields a newer peer adds are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=False)


class ShardState(StrEnum):
    """Where a shard stands, as the agent's supervisor sees it."""

    PENDING = "pending"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def shard_state_from_wire(value: Any) -> ShardState:
    """Read a shard state; an unrecognised one is FAILED.

    A newer agent reporting something this control plane does not understand
    must not be mistaken for a healthy shard.
    """
    if isinstance(value, ShardState):
        return value
    try:
        return ShardState(str(value).lower())
    except ValueError:
        return ShardState.FAILED


# --- registration -----------------------------------------------------------


class Host(Message):
    """The operating system and processor, as the agent reads them."""

    os_id: Short = ""
    os_version: Short = ""
    os_codename: Short = ""
    arch: Short = ""
    cpu_flags: Annotated[list[Short], Field(max_length=1024)] = empty_list()
    nvidia_driver: Short = ""
    kernel: Short = ""


class GPUFabric(Message):
    """A GPU's multi-node NVLink fabric, as nvidia-smi -q "Fabric" or NVML reports it."""

    state: Short = ""
    status: Short = ""
    cluster_uuid: Short = ""
    clique_id: Short = ""
    bandwidth: Short = ""
    # The driver's health summary of the card's fabric (Healthy, Unhealthy,
    # Limited Capacity); "" when the driver does not say.
    health: Short = ""


class GPU(Message):
    """One GPU as discovered at registration."""

    index: GPUIndex
    uuid: Short = ""
    name: Short = ""
    memory_total_mb: Count | None = None
    memory_used_mb: Count | None = None
    compute_capability: Short = ""
    numa_node: Annotated[int, Field(ge=-1, le=1024)] | None = None
    pci_bus_id: Short = ""
    driver_version: Short = ""
    cuda_version: Short = ""
    utilization_percent: Annotated[int, Field(ge=0, le=100)] | None = None
    nvlink_peers: Annotated[list[GPUIndex], Field(max_length=MAX_GPUS)] = empty_list()
    # HCA name -> topology path from `nvidia-smi topo -m` (PIX, PXB, NODE, SYS...).
    nic_paths: Annotated[dict[Short, Short], Field(max_length=MAX_PORTS)] = empty_dict()
    fabric: GPUFabric | None = None
    ecc_errors: Count | None = None
    temperature_c: Annotated[int, Field(ge=-100, le=300)] | None = None
    problems: Annotated[list[Text], Field(max_length=64)] = empty_list()


class Storage(Message):
    """One filesystem holding model directories."""

    path: Text
    free_bytes: Count = 0
    total_bytes: Count = 0
    shared: bool = False
    fstype: Short = ""


class LocalWeights(Message):
    """A model directory or file this node can see."""

    path: Text
    size_bytes: Count = 0
    shared: bool = False


class FabricAttachment(Message):
    """A node's declared attachment to a fabric, from agent.yaml.

    The name is the operator's; it is never derived from a GID prefix, since
    OpenSM's default fe80:: is everywhere and proves nothing.
    """

    name: Annotated[str, StringConstraints(min_length=1, max_length=63)]
    hcas: Annotated[list[Short], Field(max_length=MAX_PORTS)] = empty_list()
    rate_gbps: Annotated[int, Field(ge=0, le=100_000)] = 0


class IMEX(Message):
    """nvidia-imex on this node: without it a domain's GPUs cannot share memory across nodes."""

    state: Short = ""
    channels: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    detail: Text = ""


class EngineProfile(Message):
    """An engine profile as it travels to the agent in a StartShard."""

    name: Short = ""
    engine: Short
    gpu_class: Short = ""
    tp: Annotated[int, Field(ge=1, le=MAX_GPUS * 64)] = 1
    pp: Annotated[int, Field(ge=1, le=1024)] = 1
    gpus_per_node: Annotated[int, Field(ge=0, le=MAX_GPUS)] = 0
    nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    args: Annotated[list[Text], Field(max_length=MAX_LIST)] = empty_list()
    env: Annotated[dict[Short, Text], Field(max_length=MAX_LIST)] = empty_dict()
    model_path: Text = ""
    served_model_name: Short = ""


class RunningShard(Message):
    """A shard the agent finds running at registration, offered for adoption."""

    replica_id: Short
    shard_id: Short
    rank: SmallInt = 0
    gpu_indices: Annotated[list[GPUIndex], Field(max_length=MAX_GPUS)] = empty_list()
    hcas: Annotated[list[Short], Field(max_length=MAX_PORTS)] = empty_list()
    http_port: Port | None = None
    leader_addr: Short = ""
    state: ShardState = ShardState.FAILED
    model: Short = ""
    profile: Short = ""
    pool: Short = ""
    fabric: Short = ""
    profile_fp: Short = ""
    pid: Count | None = None

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, v: Any) -> ShardState:
        return shard_state_from_wire(v)


class EngineInstall(Message):
    """Where one engine's installation stands on a node."""

    engine: Short
    version: Short = ""
    variant: Short = ""
    state: Literal["installing", "ready", "failed", "unsupported"]
    detail: Text = ""


class Register(Message):
    """An agent's registration: the whole inventory, and the shards already running."""

    node_id: NodeId
    hostname: Name = ""
    mgmt_addr: Name = ""
    labels: Labels = empty_dict()
    agent_version: Short = ""
    features: Annotated[list[Short], Field(max_length=MAX_LIST)] = empty_list()
    engine_versions: Annotated[dict[Short, Short], Field(max_length=MAX_LIST)] = empty_dict()
    # Says engine_versions is an answer: an empty map then means "has none"
    # rather than "an agent too old to say".
    engines_probed: bool = False
    memory_total_mb: Count | None = None
    cpu_count: Annotated[int, Field(ge=0, le=100_000)] | None = None
    host: Host | None = None
    gpus: Annotated[list[GPU], Field(max_length=MAX_GPUS)] = empty_list()
    # None: the agent was not asked to look (constrains nothing).
    storage: Annotated[list[Storage], Field(max_length=MAX_LIST)] | None = None
    weights: Annotated[list[LocalWeights], Field(max_length=4096)] | None = None
    fabrics: Annotated[list[FabricAttachment], Field(max_length=16)] = empty_list()
    imex: IMEX | None = None
    running_shards: Annotated[list[RunningShard], Field(max_length=MAX_SHARDS)] = empty_list()
    engine_installs: Annotated[list[EngineInstall], Field(max_length=MAX_LIST)] | None = None
    at: float | None = None
    # A secret the agent draws before its first join with a token and keeps until
    # it holds a credential: a retry of a join whose answer was lost proves, with
    # it, that it is the same agent, and gets a credential again instead of a refusal.
    join_nonce: Annotated[str, StringConstraints(min_length=32, max_length=128)] | None = None
    # host:port of the agent's own Prometheus endpoint (path /metrics); None:
    # an agent too old to serve one, or one told not to.
    metrics_addr: MetricsAddr | None = None

    @field_validator("gpus")
    @classmethod
    def _distinct_gpu_indices(cls, v: list[GPU]) -> list[GPU]:
        seen: set[int] = set()
        for g in v:
            if g.index in seen:
                raise ValueError(f"GPU index {g.index} appears twice")
            seen.add(g.index)
        return v


class RegisterResponse(Message):
    """The control plane's answer to a registration."""

    node_id: NodeId
    # Only present when a credential was issued (first join, or after a reset):
    # the agent keeps it in its state directory, mode 0600.
    credential: Short | None = None
    heartbeat_interval_s: float = 5.0
    adopted: Annotated[list[Short], Field(max_length=MAX_SHARDS)] = empty_list()
    commands: Annotated[list[Command], Field(max_length=MAX_COMMANDS)] = empty_list()


# --- heartbeat --------------------------------------------------------------


class ShardLoad(Message):
    """One engine's use of the host: cores busy and resident memory."""

    cpu_cores: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    rss_bytes: Count = 0


class Load(Message):
    """A node's use of its CPU and memory, and what its sensors say (0 = not measured)."""

    cpu_percent: Annotated[float, Field(ge=0, le=100_000)] = 0.0
    cpu_count: Annotated[int, Field(ge=0, le=100_000)] = 0
    load1: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    load5: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    load15: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    mem_used_bytes: Count = 0
    mem_avail_bytes: Count = 0
    shards: Annotated[dict[Short, ShardLoad], Field(max_length=MAX_SHARDS)] = empty_dict()
    cpu_temp_c: Annotated[float, Field(ge=-100, le=300)] = 0.0
    cpu_power_w: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    inlet_temp_c: Annotated[float, Field(ge=-100, le=300)] = 0.0


class GPUWear(Message):
    """A card's wear and failures; -1 counts are not reported for this card."""

    pcie_replays: WearCount = -1
    retired_pages_sbe: WearCount = -1
    retired_pages_dbe: WearCount = -1
    retire_pending: bool = False
    remapped_rows_correctable: WearCount = -1
    remapped_rows_uncorrectable: WearCount = -1
    remap_pending: bool = False
    remap_failure: bool = False
    nvlink_crc_errors: WearCount = -1
    nvlink_replay_errors: WearCount = -1
    nvlink_recovery_errors: WearCount = -1
    xid_errors: WearCount = -1
    last_xid: Annotated[int, Field(ge=0, le=100_000)] = 0
    last_xid_text: Text = ""
    last_xid_at: float | None = None


class GPUSensor(Message):
    """One card's heat, power, busyness and wear at a heartbeat."""

    index: GPUIndex
    temp_c: Annotated[float, Field(ge=-100, le=300)] = 0.0
    memory_temp_c: Annotated[float, Field(ge=-100, le=300)] = 0.0
    power_w: Annotated[float, Field(ge=0, le=100_000)] = 0.0
    power_limit_w: Annotated[float, Field(ge=0, le=100_000)] = 0.0
    throttle: Annotated[list[Short], Field(max_length=32)] = empty_list()
    util_percent: Annotated[float, Field(ge=-1, le=100)] = -1
    mem_util_percent: Annotated[float, Field(ge=-1, le=100)] = -1
    memory_used_mb: Annotated[float, Field(ge=0, le=1e9)] = 0.0
    memory_total_mb: Annotated[float, Field(ge=0, le=1e9)] = 0.0
    sm_clock_mhz: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    ecc_uncorrected: Annotated[float, Field(ge=0, le=2**53)] = 0.0
    wear: GPUWear | None = None
    problems: Annotated[list[Text], Field(max_length=64)] = empty_list()


class SubnetManager(Message):
    """One subnet manager on a fabric (saquery -s / smpquery)."""

    guid: Short
    lid: Annotated[int, Field(ge=0, le=65535)] = 0
    priority: Annotated[int, Field(ge=0, le=15)] = 0
    state: Short = ""


class IBPort(Message):
    """One InfiniBand or RoCE port: state, identity and cumulative counters."""

    hca: Short
    port: Annotated[int, Field(ge=0, le=255)]
    state: Short = ""
    phys_state: Short = ""
    rate_gbps: Annotated[int, Field(ge=0, le=100_000)] = 0
    link_layer: Short = ""
    counters: Annotated[dict[Short, Count], Field(max_length=128)] = empty_dict()
    node_guid: Short = ""
    port_guid: Short = ""
    gid_prefix: Short = ""
    # The master subnet manager this port sees; sm_error says why it is empty
    # on an active InfiniBand port.
    sm_guid: Short = ""
    sm_lid: Annotated[int, Field(ge=0, le=65535)] = 0
    sm_priority: Annotated[int, Field(ge=0, le=15)] = 0
    sm_state: Short = ""
    sm_error: Text = ""
    # A RoCE port's IP network, e.g. 10.0.0.0/24.
    network: Short = ""
    netdev: Short = ""
    # Every subnet manager on the fabric, on the one port per fabric that asked.
    sms: Annotated[list[SubnetManager], Field(max_length=64)] = empty_list()
    sms_error: Text = ""


class ShardStatus(Message):
    """One shard's state at a heartbeat."""

    shard_id: Short
    replica_id: Short = ""
    state: ShardState
    reason: Text = ""
    exit_code: Annotated[int, Field(ge=-1024, le=1024)] | None = None
    http_port: Port | None = None
    log_tail: Annotated[list[Text], Field(max_length=50)] = empty_list()

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, v: Any) -> ShardState:
        return shard_state_from_wire(v)


class GPUFabricReport(Message):
    """A GPU's NVLink fabric, re-read once a minute: a fabric manager restart drops every card at once."""

    index: GPUIndex
    fabric: GPUFabric | None = None


class Heartbeat(Message):
    """What an agent sends every few seconds."""

    node_id: NodeId
    # The agent's clock (Unix seconds), to measure skew.
    at: float | None = None
    load: Load | None = None
    gpus: Annotated[list[GPUSensor], Field(max_length=MAX_GPUS)] | None = None
    ib_ports: Annotated[list[IBPort], Field(max_length=MAX_PORTS)] | None = None
    shards: Annotated[list[ShardStatus], Field(max_length=MAX_SHARDS)] = empty_list()
    engine_installs: Annotated[list[EngineInstall], Field(max_length=MAX_LIST)] | None = None
    gpu_fabrics: Annotated[list[GPUFabricReport], Field(max_length=MAX_GPUS)] | None = None
    imex: IMEX | None = None
    # Ids of commands the agent has received and applied.
    acks: Annotated[list[Short], Field(max_length=MAX_COMMANDS)] = empty_list()


# --- commands ---------------------------------------------------------------


class StartShard(Message):
    """Start one shard of a replica on this node."""

    kind: Literal["start_shard"] = "start_shard"
    id: Short = ""
    replica_id: Short
    shard_id: Short
    rank: SmallInt = 0
    nnodes: Annotated[int, Field(ge=1, le=1024)] = 1
    leader_addr: Short = ""
    leader_port: Port | None = None
    gpu_indices: Annotated[list[GPUIndex], Field(max_length=MAX_GPUS)] = empty_list()
    # Only the HCAs of the replica's own fabric: NCCL handed an adapter on a
    # second fabric picks a peer it cannot reach and hangs instead of failing.
    hcas: Annotated[list[Short], Field(max_length=MAX_PORTS)] = empty_list()
    mgmt_interface: Short = ""
    http_port: Port
    profile: EngineProfile
    startup_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 1800.0
    pool: Short = ""
    fabric: Short = ""
    nvlink_domain: Short = ""
    profile_fp: Short = ""


class StopShard(Message):
    """Stop a shard: SIGTERM, then SIGKILL after the grace period."""

    kind: Literal["stop_shard"] = "stop_shard"
    id: Short = ""
    shard_id: Short
    replica_id: Short = ""
    grace_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    reason: Text = ""


class ScanFabric(Message):
    """Run ibnetdiscover on one port and upload the text."""

    kind: Literal["scan_fabric"] = "scan_fabric"
    id: Short = ""
    key: Short
    hca: Short
    port: Annotated[int, Field(ge=0, le=255)] = 1
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0


class InstallEngine(Message):
    """Install (or check) an engine at a version."""

    kind: Literal["install_engine"] = "install_engine"
    id: Short = ""
    engine: Short
    version: Short = ""
    variant: Short = ""


Command = Annotated[StartShard | StopShard | ScanFabric | InstallEngine, Field(discriminator="kind")]


class HeartbeatResponse(Message):
    """The answer to a heartbeat: the commands pending for this node, each with an id."""

    # Bounded like every list: an agent refuses an answer with more (nothing of it is applied).
    commands: Annotated[list[Command], Field(max_length=MAX_COMMANDS)] = empty_list()
    server_time: float | None = None
    heartbeat_interval_s: float = 5.0
    # An operator asked for a new credential: the agent calls the rotate endpoint.
    rotate_credential: bool | None = None
    # This control plane takes lease renewals (wire/lease.py) between full heartbeats.
    leases: bool | None = None


class ScanUpload(Message):
    """A fabric scan's result (ibnetdiscover text, or the error)."""

    node_id: NodeId
    command_id: Short = ""
    key: Short
    hca: Short = ""
    port: Annotated[int, Field(ge=0, le=255)] = 1
    output: Annotated[str, StringConstraints(max_length=MAX_SCAN_TEXT)] = ""
    error: Text = ""
    took_s: Annotated[float, Field(ge=0, le=86_400)] = 0.0


class RotateCredential(Message):
    """Ask for a new node credential (POST /api/v1/agent/rotate, with the current one).

    The answer is a RegisterResponse carrying only node_id and credential; the
    old credential stays valid until the new one is first used.
    """

    node_id: NodeId


RegisterResponse.model_rebuild()

# Last: the lease messages (wire/lease.py) build on Command, defined above.
from wire.lease import LEASE_PATH as LEASE_PATH, Lease as Lease, LeaseResponse as LeaseResponse  # noqa: E402, I001
