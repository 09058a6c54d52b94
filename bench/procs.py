"""The processes a command started, read from /proc: for the fault suite and the tests that kill them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# What a gateway process's command line holds, by LLMGW_GATEWAY_INTERFACE (scripts/gateway.sh).
GATEWAY = {"native": "gateway.native", "asgi": "gateway.asgi:app", "rsgi": "gateway.rsgi:app"}


def gateway_needle(environ: dict[str, str] | None = None) -> str:
    """What the command line of the gateway's master and workers holds, as scripts/gateway.sh serves it."""
    env = os.environ if environ is None else environ
    return GATEWAY[env.get("LLMGW_GATEWAY_INTERFACE") or "native"]


def _table() -> dict[int, tuple[int, str]]:
    # pid -> (parent pid, command line), for every live process (zombies left out).
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(proc.name)] = (int(fields[1]), cmdline)
    return out


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every live process below `pid` (children, their children, ...)."""
    table = _table()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def find(pid: int, needle: str, *, leaf: bool = False) -> list[int]:
    """The processes below `pid` whose command line holds `needle`, oldest first.

    With `leaf`, only those none of whose children also hold it (a server's
    workers, not its master).
    """
    below = descendants(pid)
    hits = sorted(p for p, cmd in below.items() if needle in cmd)
    if not leaf:
        return hits
    table = _table()
    return [p for p in hits if not any(table.get(c, (0, ""))[0] == p for c in hits)]


def parent(pid: int) -> int:
    """The parent of a live process (0 when it is gone)."""
    return _table().get(pid, (0, ""))[0]
