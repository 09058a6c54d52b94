"""A fresh machine, as far as a test can make one: a copy of the checkout's
tracked files and virtualenvs built from nothing but what they declare.

Used by the packaging and newcomer tests. pip's download cache is shared
(fast), the shared development virtualenv never is (it hides what the run
requirements forget).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from django.conf import settings

REPO = Path(settings.BASE_DIR)
# What the test runner's environment must not leak into a "fresh" process.
LEAKY = ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE", "PYTHONHOME")


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
