"""Storage of the model directories, and the weights found in them.

A filer mounted by twenty nodes must not count as twenty free terabytes, so
each filesystem says whether it is shared (NFS, Lustre, GPFS, CephFS,
BeeGFS, WekaFS, FUSE network filesystems...).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import llmgw_wire as wire

from .tools import host_path

SHARED_FSTYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "cephfs",
        "ceph",
        "beegfs",
        "wekafs",
        "glusterfs",
        "cifs",
        "smb3",
        "9p",
        "virtiofs",
    }
)
# FUSE filesystems that are local in spite of the prefix.
LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse", "fuse.snapfuse"})


def is_shared(fstype: str) -> bool:
    """Whether a filesystem type is one many nodes mount."""
    t = fstype.strip().lower()
    if t in SHARED_FSTYPES:
        return True
    return t.startswith("fuse.") and t not in LOCAL_FUSE


@dataclass(frozen=True)
class Mount:
    """One line of /proc/mounts."""

    device: str
    point: str
    fstype: str


def parse_mounts(text: str) -> list[Mount]:
    """/proc/mounts, with octal escapes ("\\040" for a space) undone."""
    out: list[Mount] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].encode().decode("unicode_escape")
            out.append(Mount(device=parts[0], point=point, fstype=parts[2]))
    return out


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding a path: the longest mount point that prefixes it (the last one mounted wins)."""
    best: Mount | None = None
    for m in mounts:
        p = m.point.rstrip("/") or "/"
        if (path == p or path.startswith(p.rstrip("/") + "/") or p == "/") and (
            best is None or len(p) >= len(best.point.rstrip("/") or "/")
        ):
            best = m
    return best


def parse_df(text: str) -> dict[str, tuple[int, int]]:
    """`df -P -B1`: each mount point's (total, available) bytes."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 6 and parts[1].isdigit() and parts[3].isdigit():
            out[" ".join(parts[5:])] = (int(parts[1]), int(parts[3]))
    return out


def storage_for(
    paths: list[str], mounts: list[Mount], sizes: dict[str, tuple[int, int]] | None, root: Path | None
) -> tuple[list[wire.Storage], list[str]]:
    """Each model directory's filesystem; problems for those that cannot be read."""
    out: list[wire.Storage] = []
    problems: list[str] = []
    for path in paths:
        m = mount_of(path, mounts)
        fstype = m.fstype if m else ""
        total = free = 0
        if root is None:
            try:
                st = os.statvfs(path)
                total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            except OSError as exc:
                problems.append(f"model directory {path}: {exc.strerror or exc}")
                continue
        elif not host_path(root, path).exists():
            problems.append(f"model directory {path}: not found")
            continue
        elif m and sizes and m.point in sizes:
            total, free = sizes[m.point]
        out.append(wire.Storage(path=path, free_bytes=free, total_bytes=total, shared=is_shared(fstype), fstype=fstype))
    return out, problems


def _size(p: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / f).stat().st_size
    return total


def find_weights(
    paths: list[str], mounts: list[Mount], root: Path | None, *, max_depth: int = 3
) -> list[wire.LocalWeights]:
    """Model directories (config.json beside *.safetensors) and *.gguf files under the model directories."""
    out: list[wire.LocalWeights] = []
    for top in paths:
        base = host_path(root, top)
        if not base.is_dir():
            continue
        for dirpath, dirs, files in os.walk(base):
            rel = Path(dirpath).relative_to(base)
            depth = 0 if str(rel) == "." else len(rel.parts)
            if depth >= max_depth:
                dirs[:] = []
            dirs.sort()
            shown = str(Path(top) / rel) if depth else top
            fs = mount_of(shown, mounts)
            shared = is_shared(fs.fstype) if fs else False
            if "config.json" in files and any(f.endswith(".safetensors") for f in files):
                out.append(wire.LocalWeights(path=shown, size_bytes=_size(Path(dirpath)), shared=shared))
                dirs[:] = []
                continue
            for f in sorted(files):
                if f.endswith(".gguf"):
                    try:
                        size = (Path(dirpath) / f).stat().st_size
                    except OSError:
                        size = 0
                    out.append(wire.LocalWeights(path=str(Path(shown) / f), size_bytes=size, shared=shared))
    return out
