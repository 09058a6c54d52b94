"""Leases apart from status: the small message an agent sends when nothing it measures has changed.

Kubernetes splits a node's lease (a tiny object renewed every 10 s) from its
status (sent when it changes, and every few minutes); the same split here.
A full heartbeat (wire.Heartbeat) carries sensors, counters, shard states and
facts, about 9 KB for an 8-GPU node; a lease says only "this node is alive,
and has applied these commands": under 200 bytes for an agent with nothing to
acknowledge. The agent decides which to send each interval
(llmgw_agent/status.py); the control plane keeps the last status it received
and renews the lease (POST /api/v1/agent/lease, agents/lease.py). The status
floor, when nothing moved past a threshold, is a lease too: it carries the
digest the control plane answered the last status with, and the control
plane confirms it holds that status or asks for the whole one.

An agent sends leases only to a control plane that said it takes them
(HeartbeatResponse.leases): an older control plane keeps getting full
heartbeats, and an older agent never sends a lease. Where the control plane
names a `lease_url` (its gateway, which writes leases in batches:
agents/lease_asgi.py), the agent sends its leases there, and to LEASE_PATH
under the control plane when that fails.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from llmgw_wire.commands import Command
from llmgw_wire.common import MAX_COMMANDS, Message, NodeId, Short, empty_list

LEASE_PATH = "/api/v1/agent/lease"


class Lease(Message):
    """A lease renewal: the node is alive, and these commands are applied."""

    node_id: NodeId
    # The agent's clock (Unix seconds); kept for a later status's skew check, not stored.
    at: float | None = None
    # Ids of commands the agent has received and applied.
    acks: Annotated[list[Short], Field(max_length=MAX_COMMANDS)] = empty_list()
    # The status floor, as a digest: the HeartbeatResponse.status_digest of the last status this
    # control plane accepted, sent when nothing the agent measures moved past a threshold since
    # (llmgw_agent/status.py). The control plane checks that it still holds that very status and
    # asks for the whole one (send_status) when it does not. None: an ordinary lease.
    status_digest: Short | None = None


class LeaseResponse(Message):
    """The answer to a lease renewal: commands when some wait, and whether to come back at once."""

    commands: Annotated[list[Command], Field(max_length=MAX_COMMANDS)] = empty_list()
    server_time: float | None = None
    heartbeat_interval_s: float = 5.0
    # Send a full heartbeat now: the control plane lost this node's last status
    # (the cache was flushed or restarted, or the status expired).
    send_status: bool = False
    # Come back at once, without waiting for the interval: more commands wait
    # than this answer carries, or send_status is set.
    again: bool = False
    # An operator asked for a new credential: the agent calls the rotate endpoint.
    rotate_credential: bool | None = None
    # The lease carried a status_digest and it is the digest of the status this control plane holds:
    # the floor is confirmed. None: the lease carried none, or this control plane does not check
    # (an older one), and the agent sends its whole status at the next floor instead.
    status_confirmed: bool | None = None
