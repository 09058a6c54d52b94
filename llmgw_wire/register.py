"""Registration: the inventory an agent reports when it joins, the answer, and credential rotation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

from llmgw_wire.commands import Command
from llmgw_wire.common import (
    MAX_COMMANDS,
    MAX_GPUS,
    MAX_LIST,
    MAX_PORTS,
    MAX_SHARDS,
    Count,
    GPUIndex,
    HttpURL,
    Labels,
    Message,
    MetricsAddr,
    Name,
    NodeId,
    Port,
    ShardState,
    Short,
    SmallInt,
    Text,
    empty_dict,
    empty_list,
    shard_state_from_wire,
)


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
    # Where this control plane serves the wakeup long-poll (its gateway); None: it names none.
    wakeup_url: HttpURL | None = None
    # Where this control plane takes leases in batches (POST, its gateway); None: the lease path here.
    # An agent that gets no answer there sends its lease here instead (llmgw_wire/lease.py).
    lease_url: HttpURL | None = None


class RotateCredential(Message):
    """Ask for a new node credential (POST /api/v1/agent/rotate, with the current one).

    The answer is a RegisterResponse carrying only node_id and credential; the
    old credential stays valid until the new one is first used.
    """

    node_id: NodeId
