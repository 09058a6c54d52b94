"""The engines' processes as the supervisor handles them: who a pid is, signals to a group, log files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def proc_identity(pid: int, *, proc: Path = Path("/proc")) -> tuple[int, list[str]] | None:
    """(start time in clock ticks, argv) of a live process, None when gone or a zombie."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # The command name may hold spaces and parentheses: fields start after the last ")".
    rest = stat[stat.rfind(")") + 2 :].split()
    if not rest or rest[0] in ("Z", "X"):
        return None
    return int(rest[19]), [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]


def signal_group(pid: int, sig: int) -> None:
    """Signal a shard's process, and its whole group when it leads its own session (the engine's workers)."""
    try:
        # Its own session: the pid is the process group; signal the engine's workers too.
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def rotate_log(path: Path, backups: int) -> None:
    """Copy-and-truncate rotation: the engine keeps its file open (O_APPEND) across it."""
    if not path.exists() or path.stat().st_size == 0:
        return
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    if backups > 0:
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with open(path, "r+b") as f:
        f.truncate(0)


def log_tail(path: Path, lines: int, *, window: int = 64 * 1024) -> list[str]:
    """The last whole lines of a log, from its last `window` bytes.

    Lines are returned whole, not cut: what leaves the node is redacted first
    and bounded after (wire.bounded_tail), and a line cut before its
    redaction could keep half a secret that no longer looks like one. For the
    same reason the window's first line is dropped when the window starts
    inside the file: it is the end of a line, not a line.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - window))
            data = f.read()
    except OSError:
        return []
    out = data.decode(errors="replace").splitlines()
    if size > window:
        out = out[1:]
    return out[-lines:]
