"""Running the tools discovery reads (nvidia-smi, sminfo, ...), live or recorded.

A tool that is missing, exits non-zero or times out is a reported problem
(`ToolResult.ok` False with the reason), never an exception: a node without
infiniband-diags or without IMEX still registers with what it has.

Fixture mode reads a recorded output instead of running the tool. The
recording's name comes from the argv: the program's base name and every
argument joined with "_", each character outside [A-Za-z0-9._=+-] replaced
by "-", then ".txt", under `root/cmd/`:

    ["nvidia-smi", "-q"]                   -> cmd/nvidia-smi_-q.txt
    ["nvidia-smi", "topo", "-m"]           -> cmd/nvidia-smi_topo_-m.txt
    ["sminfo", "-C", "mlx5_0", "-P", "1"]  -> cmd/sminfo_-C_mlx5_0_-P_1.txt

Beside it, `<name>.stderr` records what the tool printed on its standard
error (llama-server prints its version there, and a recording that put it on
stdout hid that discovery never read it), `<name>.err` a failure (its text is
the error) and `<name>.timeout` a tool that hung; no recording at all reads as
a tool that is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


@dataclass(frozen=True)
class ToolResult:
    """What a tool said: its standard output, or why there is none."""

    ok: bool
    stdout: str = ""
    error: str = ""
    stderr: str = ""
    # The tool is not on this machine (or has no recording): absent, not broken.
    missing: bool = False


def recording_name(argv: list[str]) -> str:
    """The file name (without directory) a tool's output is recorded under."""
    parts = [os.path.basename(argv[0]), *argv[1:]]
    return _UNSAFE.sub("-", "_".join(parts))


def run_tool(argv: list[str], *, root: Path | None, timeout: float, record: str | None = None) -> ToolResult:
    """Run `argv` (never through a shell), or read its recording under `root`.

    `record` names the recording when the argv makes a poor file name (a
    `python -c` probe).
    """
    if not argv:
        return ToolResult(ok=False, error="empty command")
    if root is not None:
        return _recorded(argv, Path(root) / "cmd", record or recording_name(argv))
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
            errors="replace",
        )
    except FileNotFoundError:
        return ToolResult(ok=False, error=f"{argv[0]}: not installed", missing=True)
    except PermissionError as exc:
        return ToolResult(ok=False, error=f"{argv[0]}: {exc.strerror or 'permission denied'}")
    except subprocess.TimeoutExpired:
        return ToolResult(ok=False, error=f"{argv[0]}: timed out after {timeout:g}s")
    except OSError as exc:
        return ToolResult(ok=False, error=f"{argv[0]}: {exc}")
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        tail = detail[-1] if detail else ""
        return ToolResult(ok=False, stdout=proc.stdout, error=f"{argv[0]}: exit {proc.returncode}: {tail}".rstrip(": "))
    return ToolResult(ok=True, stdout=proc.stdout, stderr=proc.stderr)


def _recorded(argv: list[str], cmd_dir: Path, name: str) -> ToolResult:
    if (cmd_dir / f"{name}.timeout").exists():
        return ToolResult(ok=False, error=f"{argv[0]}: timed out")
    err = cmd_dir / f"{name}.err"
    if err.exists():
        return ToolResult(ok=False, error=f"{argv[0]}: {err.read_text(errors='replace').strip()}")
    out, err_stream = cmd_dir / f"{name}.txt", cmd_dir / f"{name}.stderr"
    if out.exists() or err_stream.exists():
        return ToolResult(
            ok=True,
            stdout=out.read_text(errors="replace") if out.exists() else "",
            stderr=err_stream.read_text(errors="replace") if err_stream.exists() else "",
        )
    return ToolResult(ok=False, error=f"{argv[0]}: not installed", missing=True)


def host_path(root: Path | None, path: str) -> Path:
    """A path of the machine, or the same path under the fixture root."""
    if root is None:
        return Path(path)
    return Path(root) / path.lstrip("/")


def read_text(root: Path | None, path: str) -> str | None:
    """A small file's text (sysfs, /proc, /etc), None when it cannot be read."""
    try:
        return host_path(root, path).read_text(errors="replace")
    except OSError:
        return None
