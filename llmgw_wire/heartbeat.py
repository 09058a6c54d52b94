"""The heartbeat: load, sensors, port counters and shard states an agent reports every few seconds.

And its answer, which carries the commands pending for the node.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from llmgw_wire.commands import Command
from llmgw_wire.common import (
    MAX_COMMANDS,
    MAX_GPUS,
    MAX_LIST,
    MAX_LISTENING,
    MAX_PORTS,
    MAX_SHARDS,
    Count,
    GPUIndex,
    HttpURL,
    Message,
    NodeId,
    Port,
    ShardState,
    Short,
    Text,
    WearCount,
    empty_dict,
    empty_list,
    shard_state_from_wire,
)
from llmgw_wire.register import IMEX, EngineInstall, GPUFabric


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
    # A failed shard's end of its engine's output, redacted and bounded by the agent
    # (wire.bounded_tail; an older agent sent it raw, so the control plane does it again).
    log_tail: Annotated[list[Text], Field(max_length=50)] = empty_list()
    # Set on a shard that failed because its port was taken on the node when the agent
    # checked it, before any engine ran: a fact about the node, not the deployment's failure.
    port_in_use: Port | None = None

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
    # The TCP ports listening on the node (IPv4 and IPv6), lowest first; None: not reported
    # (an older agent). The planner hands out no shard port in this list.
    listening_ports: Annotated[list[Port], Field(max_length=MAX_LISTENING)] | None = None
    # Ids of commands the agent has received and applied.
    acks: Annotated[list[Short], Field(max_length=MAX_COMMANDS)] = empty_list()


class HeartbeatResponse(Message):
    """The answer to a heartbeat: the commands pending for this node, each with an id."""

    # Bounded like every list: an agent refuses an answer with more (nothing of it is applied).
    commands: Annotated[list[Command], Field(max_length=MAX_COMMANDS)] = empty_list()
    server_time: float | None = None
    heartbeat_interval_s: float = 5.0
    # An operator asked for a new credential: the agent calls the rotate endpoint.
    rotate_credential: bool | None = None
    # This control plane takes lease renewals (llmgw_wire/lease.py) between full heartbeats.
    leases: bool | None = None
    # Where this control plane serves the wakeup long-poll (its gateway); None: it names none.
    wakeup_url: HttpURL | None = None
    # Where this control plane takes leases in batches (POST, its gateway); None: the lease path here.
    # An agent that gets no answer there sends its lease here instead (llmgw_wire/lease.py).
    lease_url: HttpURL | None = None
    # The digest of this status as the control plane keeps it: a later lease carrying it
    # (Lease.status_digest) stands for a status floor at which nothing changed. None: send the
    # whole status at the floor (a control plane that keeps no digest).
    status_digest: Short | None = None
