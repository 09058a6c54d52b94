"""The TCP ports in use on this node: what listens (from /proc), and whether one is free to bind now.

The control plane hands out shard ports; what else runs on the node (the
control plane itself, a database, a second agent's engines) it cannot see.
Handed a port that another program listens on, an engine dies with "Address
already in use" long after the decision, and the failure read like the
engine's own. So the agent reports the ports that listen on its node with its
status (the planner keeps off them), and tries to bind a shard's port right
before it starts the engine: a port taken in between is reported as exactly
that, at once, and the control plane places the replica on another port.

This reads the live /proc even when discovery reads a recorded profile: the
engines are real processes on this host whatever the hardware looks like.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from pathlib import Path

import llmgw_wire as wire

# /proc/net/tcp's "st" column: TCP_LISTEN (include/net/tcp_states.h).
LISTEN = "0A"
# A heartbeat carries at most this many (the lowest first): enough for any node that serves engines.
MAX_REPORTED = wire.MAX_LISTENING


def parse_proc_net_tcp(text: str) -> set[int]:
    """The local ports of the listening sockets in a /proc/net/tcp or /proc/net/tcp6 text.

    Each line after the header is `sl: local rem st ...`, the local address as
    hex ADDR:PORT; a malformed line is skipped, never fatal.
    """
    out: set[int] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != LISTEN:
            continue
        _, _, port = fields[1].rpartition(":")
        with contextlib.suppress(ValueError):
            p = int(port, 16)
            if 0 < p < 65536:
                out.add(p)
    return out


def listening_ports(*, proc: Path = Path("/proc")) -> list[int]:
    """The TCP ports listening on this node (IPv4 and IPv6), sorted, at most MAX_REPORTED."""
    found: set[int] = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            found |= parse_proc_net_tcp((proc / "net" / name).read_text())
    return sorted(found)[:MAX_REPORTED]


def taken(ports: Iterable[int]) -> int | None:
    """The first of these ports this node cannot bind now, None when all are free.

    Bound as an engine binds (all addresses, SO_REUSEADDR), so a socket
    lingering in TIME_WAIT does not count, and a listener on any address does.
    """
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return port
    return None
