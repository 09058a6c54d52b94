"""The host: OS, architecture, CPU flags, and the memory and CPUs the agent may use.

Inside a container or a systemd slice the machine's totals lie: a cgroup
caps memory (memory.max) and CPU time (cpu.max), and the scheduler may
allow only some CPUs (Cpus_allowed_list). The smaller figure is the truth.
"""

from __future__ import annotations

import math
from pathlib import Path

import llmgw_wire as wire

from .tools import read_text


def parse_os_release(text: str) -> dict[str, str]:
    """/etc/os-release as a map, quotes removed."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"').strip("'")
    return out


def parse_cpu_flags(cpuinfo: str) -> list[str]:
    """The first processor's flags (x86 "flags", Arm "Features"), sorted."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return []


def count_processors(cpuinfo: str) -> int | None:
    """How many "processor" entries /proc/cpuinfo lists."""
    n = sum(1 for line in cpuinfo.splitlines() if line.split(":")[0].strip() == "processor")
    return n or None


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            mult = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            out[key.strip()] = int(parts[0]) * mult
    return out


def parse_cpu_list(text: str) -> int | None:
    """How many CPUs a list such as "0-47,96-143" names."""
    total = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        total += (int(hi) - int(lo) + 1) if hi else 1
    return total or None


def parse_status_cpus(status: str) -> int | None:
    """The CPUs this process may run on, from /proc/self/status."""
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    return None


def parse_cpu_max(text: str) -> int | None:
    """cgroup v2 cpu.max ("quota period") as whole CPUs; None when unlimited."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max" or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return max(1, math.ceil(int(parts[0]) / int(parts[1])))


def parse_memory_max(text: str) -> int | None:
    """cgroup v2 memory.max in bytes; None when unlimited."""
    t = text.strip()
    return int(t) if t.isdigit() else None


def cgroup_dir(root: Path | None) -> str:
    """This process's cgroup v2 directory under /sys/fs/cgroup."""
    for line in (read_text(root, "/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            return "/sys/fs/cgroup" + line[3:].strip().rstrip("/")
    return "/sys/fs/cgroup"


def memory_total_mb(root: Path | None) -> int | None:
    """Memory the agent's engines may use: the machine's, capped by the cgroup."""
    total = parse_meminfo(read_text(root, "/proc/meminfo") or "").get("MemTotal")
    cap = parse_memory_max(read_text(root, cgroup_dir(root) + "/memory.max") or "")
    candidates = [v for v in (total, cap) if v]
    return min(candidates) // (1024 * 1024) if candidates else None


def cpu_count(root: Path | None) -> int | None:
    """CPUs the agent's engines may use: the allowed set, capped by the cgroup quota."""
    allowed = parse_status_cpus(read_text(root, "/proc/self/status") or "")
    if allowed is None:
        allowed = count_processors(read_text(root, "/proc/cpuinfo") or "")
    quota = parse_cpu_max(read_text(root, cgroup_dir(root) + "/cpu.max") or "")
    candidates = [v for v in (allowed, quota) if v]
    return min(candidates) if candidates else None


def read_host(root: Path | None, *, arch: str, nvidia_driver: str) -> wire.Host:
    """The OS and processor as /etc/os-release, /proc and uname say."""
    osr = parse_os_release(read_text(root, "/etc/os-release") or "")
    return wire.Host(
        os_id=osr.get("ID", ""),
        os_version=osr.get("VERSION_ID", ""),
        os_codename=osr.get("VERSION_CODENAME", ""),
        arch=arch,
        cpu_flags=parse_cpu_flags(read_text(root, "/proc/cpuinfo") or "")[:1024],
        nvidia_driver=nvidia_driver,
        kernel=(read_text(root, "/proc/sys/kernel/osrelease") or "").strip(),
    )


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """/proc/loadavg's three averages."""
    parts = text.split()
    try:
        return float(parts[0]), float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        return 0.0, 0.0, 0.0


def parse_proc_stat(text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat's first line."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:] if v.isdigit()]
            if len(vals) < 4:
                return None
            idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
            return sum(vals) - idle, sum(vals)
    return None
