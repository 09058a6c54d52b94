"""The commands the control plane queues for an agent, and the scan upload answering ScanFabric.

Delivered in heartbeat and registration answers (wire.heartbeat, wire.register).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from llmgw_wire.common import (
    MAX_GPUS,
    MAX_LIST,
    MAX_PORTS,
    MAX_SCAN_TEXT,
    GPUIndex,
    Message,
    NodeId,
    Port,
    Short,
    SmallInt,
    Text,
    empty_dict,
    empty_list,
)


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
