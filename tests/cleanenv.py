"""A fresh machine, as far as a test can make one: a copy of the checkout's
tracked files and virtualenvs built from nothing but what they declare.

Used by the packaging and newcomer tests. pip's download cache is shared
(fast), the shared development virtualenv never is (it hides what the run
requirements forget).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from django.conf import settings

T = TypeVar("T")

REPO = Path(settings.BASE_DIR)
# What the test runner's environment must not leak into a "fresh" process: under
# `make test`, make's own variables too, or a child make reports itself as a sub-make.
LEAKY = (
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "DJANGO_SETTINGS_MODULE",
    "PYTHONHOME",
    "MAKEFLAGS",
    "MAKELEVEL",
    "MFLAGS",
    "MAKEOVERRIDES",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment less what would make a child see the development setup."""
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env.update(extra)
    return env


def copy_tracked_files(dest: Path) -> Path:
    """Copy every file git tracks in the checkout to dest (links stay links); return dest.

    Tracked files, as they are in the working tree: a file the project needs
    but git does not know would be missing from a fresh clone, so it is
    missing here too.
    """
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)
    return dest


def run(cmd: list[str], *, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """Run cmd to the end; fail the test with its output unless it exits 0; return stdout+stderr."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{output[-6000:]}"
    return output


def make_venv(path: Path) -> Path:
    """A new virtualenv at path with this interpreter's Python; return its bin/ folder."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    run([base_python, "-m", "venv", str(path)], cwd=path.parent)
    return path / "bin"


def free_port() -> int:
    """A TCP port on 127.0.0.1 the OS says is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], T], *, timeout: float, what: str, context: Callable[[], str] = str) -> T:
    """Poll cond until it returns something true, and return that; fail naming what after timeout seconds."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= end:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{context()}")
        time.sleep(0.5)


class Background:
    """A command running in a process group of its own, its output in a file.

    stop() ends the whole group, so nothing a `make` target started outlives
    the test.
    """

    def __init__(self, cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        """Whether the command itself still runs."""
        return self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the group (the orderly stop the README's Ctrl-C gives), SIGKILL what is left after grace_s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and group_alive(self.proc.pid):
            self.proc.poll()
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (a zombie leader does not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def processes_under(folder: Path) -> dict[int, str]:
    """{pid: command line} of every process whose command line or working directory lies in folder."""
    marker = str(folder)
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            cwd = os.readlink(proc / "cwd")
            if (marker in cmdline or cwd.startswith(marker)) and int(proc.name) != os.getpid():
                found[int(proc.name)] = cmdline
    return found


def kill_processes_under(folder: Path) -> dict[int, str]:
    """SIGKILL every process processes_under(folder) finds; return them.

    The folder is a test's own temporary one, so these are processes the test
    started: engines that run in sessions of their own, on purpose, to outlive
    their agent.
    """
    found = processes_under(folder)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found
