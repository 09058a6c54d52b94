"""A simulated fleet: N real agent processes in fixture mode, from the shipped node profiles.

Each simulated node gets its own copy of a profile (llmgw_sim/profiles/<name>/),
its own node id, its own GPU UUIDs and, for profiles whose cards are joined to
an NVLink domain, the ClusterUUID of its simulated domain (`domain_size` nodes
per domain), so the control plane sees several racks rather than one. Its
fabrics are declared from the profile's adapters as an operator would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmgw_agent.supervisor import proc_identity

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_CLUSTER = re.compile(r"^(\s*ClusterUUID\s*:\s*)(\S+)\s*$", re.MULTILINE)
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_RATE = re.compile(r"(\d+)")
_SM_GUID = re.compile(r"sm guid (0x[0-9a-fA-F]+)")
NS = uuid.UUID("6f1c2a52-5f0e-4d59-9a53-2b8f0a9c1e77")


def shipped_profiles() -> list[str]:
    """The names of the recorded node profiles that ship with the agent."""
    if not PROFILES_DIR.is_dir():
        return []
    return sorted(p.name for p in PROFILES_DIR.iterdir() if (p / "cmd").is_dir())


def in_nvlink_domain(root: Path) -> bool:
    """Whether a profile's cards report a cluster UUID other than zeros (a multi-node NVLink domain)."""
    smi = root / "cmd" / "nvidia-smi_-q.txt"
    if not smi.exists():
        return False
    return any(v.strip() not in ("", ZERO_UUID, "N/A") for _, v in _CLUSTER.findall(smi.read_text(errors="replace")))


def domain_uuid(profile: str, domain: int) -> str:
    """The ClusterUUID of simulated domain number `domain` of a profile (stable across runs)."""
    return str(uuid.uuid5(NS, f"domain/{profile}/{domain}"))


def _rewrite_text_files(root: Path, fn) -> None:
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 4 * 1024 * 1024:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        new = fn(path, text)
        if new != text:
            path.write_text(new)


def derive_fabrics(root: Path) -> list[dict]:
    """Fabrics as an operator would declare them from the profile's adapters.

    RoCE ports form one fabric ("roce-a"); InfiniBand ports are
    grouped by the master subnet manager their port 1 sees (the recorded sminfo,
    else sysfs's sm_lid), named ib-a, ib-b... in HCA order; rate is the slowest port's.
    """
    ib = root / "sys" / "class" / "infiniband"
    if not ib.is_dir():
        return []
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for hca in sorted(p.name for p in ib.iterdir()):
        port = ib / hca / "ports" / "1"
        layer = _read(port / "link_layer") or "InfiniBand"
        rate_m = _RATE.match(_read(port / "rate"))
        rate = int(rate_m.group(1)) if rate_m else 0
        key = ("roce", "") if layer.lower() == "ethernet" else ("ib", _master_sm(root, hca))
        groups.setdefault(key, []).append((hca, rate))
    out = []
    counters = {"ib": 0, "roce": 0}
    for (kind, _), members in groups.items():
        name = f"{kind}-{chr(ord('a') + counters[kind])}"
        counters[kind] += 1
        rates = [r for _, r in members if r]
        out.append({"name": name, "hcas": [h for h, _ in members], "rate_gbps": min(rates) if rates else 0})
    return out


def _master_sm(root: Path, hca: str) -> str:
    """The master SM an adapter's port 1 sees: the recorded sminfo's GUID, else sysfs's sm_lid."""
    m = _SM_GUID.search(_read(root / "cmd" / f"sminfo_-C_{hca}_-P_1.txt"))
    if m:
        return m.group(1).lower()
    return _read(root / "sys" / "class" / "infiniband" / hca / "ports" / "1" / "sm_lid")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@dataclass
class SimNode:
    """One simulated node: where its files are, and its agent process once started."""

    node_id: str
    profile: str
    dir: Path
    domain: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def config(self) -> Path:
        return self.dir / "agent.yaml"

    @property
    def root(self) -> Path:
        return self.dir / "root"

    def fabrics(self) -> list[dict]:
        """The fabrics its agent.yaml declares."""
        return yaml.safe_load(self.config.read_text()).get("fabrics") or []


def prepare_node(
    *,
    index: int,
    profile: str,
    workdir: Path,
    control_plane: str,
    token_file: Path,
    domain_size: int = 2,
    heartbeat_interval: float = 5.0,
    profiles_dir: Path = PROFILES_DIR,
    ordinal: int | None = None,
    wakeup_url: str = "",
) -> SimNode:
    """Copy a profile for simulated node `index`, rewrite its identities, write its agent.yaml.

    `ordinal` is the node's number among the nodes of its profile (default:
    `index`); domains are filled by it, so a mixed fleet still puts
    `domain_size` trays of one profile in each NVLink domain.
    """
    node_id = f"sim-{profile}-{index:02d}"
    node = SimNode(node_id=node_id, profile=profile, dir=workdir / node_id)
    if node.root.exists():
        shutil.rmtree(node.root)
    node.dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(profiles_dir / profile, node.root, symlinks=True)
    if in_nvlink_domain(node.root):
        node.domain = domain_uuid(profile, (index if ordinal is None else ordinal) // max(1, domain_size))

    def rewrite(path: Path, text: str) -> str:
        # Every GPU UUID is the node's own: two simulated nodes must not share a card.
        text = _GPU_UUID.sub(lambda m: "GPU-" + str(uuid.uuid5(NS, f"{node_id}/{m.group(0)}")), text)
        if node.domain and path.name == "nvidia-smi_-q.txt":
            text = _CLUSTER.sub(
                lambda m: m.group(1) + (m.group(2) if m.group(2) in (ZERO_UUID, "N/A") else node.domain), text
            )
        return text

    _rewrite_text_files(node.root, rewrite)
    cfg = {
        "control_plane": control_plane,
        "join_token_file": str(token_file),
        "node_id": node_id,
        "labels": {"simulated": "true", "profile": profile},
        "state_dir": str(node.dir / "state"),
        "heartbeat_interval": heartbeat_interval,
        "fabrics": derive_fabrics(node.root),
    }
    if wakeup_url:
        cfg["wakeup_url"] = wakeup_url
    node.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return node


class Fleet:
    """N simulated nodes: prepared, started as real agent processes, stopped together."""

    def __init__(
        self,
        *,
        nodes: int,
        control_plane: str,
        join_token: str,
        workdir: Path,
        profiles: list[str] | None = None,
        domain_size: int = 2,
        heartbeat_interval: float = 5.0,
        profiles_dir: Path = PROFILES_DIR,
        wakeup_url: str = "",
    ) -> None:
        names = profiles or shipped_profiles()
        if not names:
            raise ValueError(f"no node profiles in {profiles_dir}")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        token_file = self.workdir / "join-token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(join_token)
        self.nodes = [
            prepare_node(
                index=i,
                profile=names[i % len(names)],
                ordinal=i // len(names),
                workdir=self.workdir,
                control_plane=control_plane,
                token_file=token_file,
                domain_size=domain_size,
                heartbeat_interval=heartbeat_interval,
                profiles_dir=profiles_dir,
                wakeup_url=wakeup_url,
            )
            for i in range(nodes)
        ]

    def start(self, *, extra_args: list[str] | None = None) -> None:
        """Start one agent process per node (python -m llmgw_agent --root <its copy>)."""
        for n in self.nodes:
            log = open(n.dir / "agent.log", "ab")  # noqa: SIM115 - the child keeps it
            n.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmgw_agent",
                    "--config",
                    str(n.config),
                    "--root",
                    str(n.root),
                    *list(extra_args or []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()

    def stop(self, *, grace_s: float = 10.0, stop_shards: bool = True) -> None:
        """SIGTERM every agent, SIGKILL what is left after the grace period; then their echo shards."""
        for n in self.nodes:
            if n.proc and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for n in self.nodes:
            if n.proc:
                try:
                    n.proc.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait()
        if stop_shards:
            for n in self.nodes:
                for rec in (n.dir / "state" / "shards").glob("*.json"):
                    with contextlib.suppress(OSError, ValueError):
                        data = json.loads(rec.read_text())
                        pid, start = data.get("pid"), data.get("proc_start")
                        ident = proc_identity(pid) if pid else None
                        if ident and ident[0] == start:
                            os.killpg(pid, signal.SIGKILL)
                        rec.unlink()

    def alive(self) -> list[SimNode]:
        """The nodes whose agent still runs."""
        return [n for n in self.nodes if n.proc and n.proc.poll() is None]
