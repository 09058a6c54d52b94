"""Hardware discovery for the node agent: pure parsers over sysfs, /proc and tool outputs.

`root=None` reads the live machine; `root=DIR` reads DIR/sys, DIR/proc,
DIR/etc, DIR/dev and the recorded tool outputs DIR/cmd/*.txt (see
`tools.recording_name`) through the same parsers. Nothing here raises for a
missing GPU, NVML, HCA, IMEX or tool: it is reported in `problems`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llmgw_wire as wire

from . import health, host, imex, infiniband, nvidia_smi, storage, subnet, topo
from .engines import probe_engines
from .nvml import read_nvml
from .readings import GPUReading, to_gpu, to_sensor
from .tools import ToolResult, host_path, read_text, run_tool

__all__ = [
    "SLOW_READ_INTERVAL",
    "Discovery",
    "Sample",
    "SlowReads",
    "ToolResult",
    "discover",
    "gpu_fabrics",
    "ibnetdiscover",
    "run_tool",
    "sample",
]

TOOL_TIMEOUT = 20.0
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
# How often a heartbeat re-runs the slow reads (dmesg's XIDs, sminfo per
# port, saquery per fabric, nvidia-imex-ctl); in between it reports the last
# results. saquery asks the subnet manager itself: every node of a large
# cluster asking at every heartbeat would load it with thousands of queries a
# second for answers that change on a failover.
SLOW_READ_INTERVAL = 60.0
# The subnet-manager fields of a port, the ones `sminfo` and `saquery` fill.
_SM_FIELDS = ("sm_guid", "sm_lid", "sm_priority", "sm_state", "sm_error", "sms", "sms_error")


@dataclass
class Discovery:
    """Everything a registration reports about the machine."""

    host: wire.Host
    memory_total_mb: int | None
    cpu_count: int | None
    gpus: list[wire.GPU]
    storage: list[wire.Storage]
    # None when no model directory is configured: the node did not look,
    # which must not read as "has no weights" at the control plane.
    weights: list[wire.LocalWeights] | None
    imex: wire.IMEX | None
    engine_versions: dict[str, str]
    engines_probed: bool
    problems: list[str] = field(default_factory=list)


@dataclass
class SlowReads:
    """The results of the slow reads, kept from one heartbeat to the next.

    `key` is what they were read for (whether the node has cards, and each
    active InfiniBand port with its link-down count): when it changes, the
    reads are made again at once, so a port that went down, came up or
    flapped never reports a subnet manager it was not asked about.
    """

    at: float
    key: tuple[Any, ...]
    xids: list[health.KernelXid]
    subnet: dict[tuple[str, int], dict[str, Any]]
    imex: wire.IMEX | None
    imex_problems: list[str]


@dataclass
class Sample:
    """What one heartbeat reports; `previous` of the next sample, for rates and the slow reads."""

    load: wire.Load
    gpus: list[wire.GPUSensor]
    ib_ports: list[wire.IBPort]
    imex: wire.IMEX | None
    problems: list[str] = field(default_factory=list)
    at: float = 0.0
    cpu_jiffies: tuple[int, int] | None = None
    pcie_replays: dict[int, int] = field(default_factory=dict)
    slow: SlowReads | None = None


def _readings(root: Path | None) -> tuple[list[GPUReading], str, list[str]]:
    """The cards (NVML live, else `nvidia-smi -q`), the driver version, problems."""
    problems: list[str] = []
    readings: list[GPUReading] = []
    nvml_ok = False
    if root is None:
        readings, nvml_problems, nvml_ok = read_nvml()
        problems += nvml_problems
    smi: nvidia_smi.SmiReport | None = None
    need_smi = not nvml_ok or any(r.fabric is None for r in readings)
    if need_smi:
        res = run_tool(["nvidia-smi", "-q"], root=root, timeout=TOOL_TIMEOUT)
        if res.ok:
            smi = nvidia_smi.parse_query(res.stdout)
        elif nvml_ok or (root is not None and not res.missing):
            problems.append(f"nvidia-smi -q: {res.error}")
    if not nvml_ok and smi is not None:
        readings = smi.gpus
    elif smi is not None:
        # NVML without the fabric call (an older driver): take the fabric from nvidia-smi.
        by_bus = {g.pci_bus_id.lower(): g for g in smi.gpus}
        for r in readings:
            other = by_bus.get(r.pci_bus_id.lower())
            if r.fabric is None and other is not None:
                r.fabric = other.fabric
    driver = readings[0].driver_version if readings else (smi.driver_version if smi else "")
    return readings, driver, problems


def _topology(root: Path | None, problems: list[str]) -> dict[int, topo.GPUTopo]:
    res = run_tool(["nvidia-smi", "topo", "-m"], root=root, timeout=TOOL_TIMEOUT)
    if not res.ok:
        # Without nvidia-smi (an NVML-only install) the paths are unknown, not wrong.
        if not res.missing:
            problems.append(f"nvidia-smi topo -m: {res.error}")
        return {}
    return topo.parse_topo(res.stdout)


def read_imex(root: Path | None) -> tuple[wire.IMEX | None, list[str]]:
    """IMEX's state and channels; None on a node with neither the tool nor a channel."""
    try:
        names = [p.name for p in host_path(root, IMEX_CHANNELS).iterdir()]
    except OSError:
        names = []
    channels = imex.count_channels(names)
    res = run_tool(["nvidia-imex-ctl", "-N"], root=root, timeout=TOOL_TIMEOUT)
    if res.missing and not channels:
        return None, []
    if not res.ok:
        return wire.IMEX(state="DOWN", channels=channels, detail=res.error[:4096]), [f"IMEX: {res.error}"]
    status = imex.parse_imex_ctl(res.stdout)
    problems = [] if channels else ["IMEX is running but no channel device exists under " + IMEX_CHANNELS]
    return wire.IMEX(state=status.domain_state or "UNKNOWN", channels=channels, detail=status.detail()), problems


def _arch(root: Path | None) -> str:
    res = run_tool(["uname", "-m"], root=root, timeout=5.0)
    return res.stdout.strip() if res.ok else ""


def discover(*, root: Path | None, model_dirs: list[str], engines_live: bool = False) -> Discovery:
    """The whole inventory of this machine, or of the recorded profile at `root` (engines live: `engines_live`)."""
    root = Path(root) if root is not None else None
    problems: list[str] = []
    readings, driver, gpu_problems = _readings(root)
    problems += gpu_problems
    topology = _topology(root, problems) if readings else {}
    gpus: list[wire.GPU] = []
    for r in readings:
        t = topology.get(r.index)
        if t is not None and r.numa_node is None:
            r.numa_node = t.numa_node
        gpus.append(to_gpu(r, nic_paths=t.nic_paths if t else {}, nvlink_peers=t.nvlink_peers if t else []))
    mounts = storage.parse_mounts(read_text(root, "/proc/mounts") or "")
    sizes = None
    if root is not None:
        df = run_tool(["df", "-P", "-B1"], root=root, timeout=TOOL_TIMEOUT)
        sizes = storage.parse_df(df.stdout) if df.ok else None
    stor, stor_problems = storage.storage_for(model_dirs, mounts, sizes, root)
    problems += stor_problems
    weights = storage.find_weights(model_dirs, mounts, root) if model_dirs else None
    imex_state, imex_problems = read_imex(root)
    problems += imex_problems
    versions, engine_problems = probe_engines(root, timeout=TOOL_TIMEOUT, live=engines_live)
    problems += engine_problems
    return Discovery(
        host=host.read_host(root, arch=_arch(root), nvidia_driver=driver),
        memory_total_mb=host.memory_total_mb(root),
        cpu_count=host.cpu_count(root),
        gpus=gpus,
        storage=stor,
        weights=weights,
        imex=imex_state,
        engine_versions=versions,
        engines_probed=True,
        problems=problems,
    )


def gpu_fabrics(*, root: Path | None) -> list[wire.GPUFabricReport]:
    """Each card's NVLink fabric, re-read: a fabric-manager restart drops every card at once."""
    readings, _driver, _problems = _readings(Path(root) if root is not None else None)
    return [wire.GPUFabricReport(index=r.index, fabric=r.fabric) for r in readings]


def _ib_ports(root: Path | None, problems: list[str]) -> list[wire.IBPort]:
    """Every port from sysfs, a RoCE port with its IP network; no subnet managers (`_subnet_managers`)."""
    ports = infiniband.read_ports(root)
    networks: dict[str, list[str]] | None = None
    for p in ports:
        if not infiniband.port_active(p) or p.link_layer.lower() != "ethernet":
            continue
        if networks is None:
            res = run_tool(["ip", "-j", "addr"], root=root, timeout=TOOL_TIMEOUT)
            networks = infiniband.parse_ip_addr_json(res.stdout) if res.ok else {}
            if not res.ok:
                problems.append(f"ip -j addr: {res.error}")
        nets = networks.get(p.netdev, [])
        p.network = nets[0] if nets else ""
    return ports


def _sm_ports(ports: list[wire.IBPort]) -> list[wire.IBPort]:
    """The ports a subnet manager answers on: active, and InfiniBand rather than RoCE."""
    return [p for p in ports if infiniband.port_active(p) and p.link_layer.lower() != "ethernet"]


def _subnet_managers(root: Path | None, ports: list[wire.IBPort]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each active InfiniBand port's subnet-manager fields, by (HCA, port).

    `sminfo` on every such port; `saquery -s` on one port per fabric.
    """
    out: dict[tuple[str, int], dict[str, Any]] = {}
    asked: set[str] = set()
    for p in _sm_ports(ports):
        found: dict[str, Any] = out.setdefault((p.hca, p.port), {})
        res = run_tool(["sminfo", "-C", p.hca, "-P", str(p.port)], root=root, timeout=TOOL_TIMEOUT)
        sm = subnet.parse_sminfo(res.stdout) if res.ok else None
        if sm is None:
            found["sm_error"] = res.error if not res.ok else "sminfo named no subnet manager"
            continue
        found.update(sm_guid=sm.guid, sm_lid=sm.lid, sm_priority=sm.priority, sm_state=sm.state)
        if sm.guid in asked:
            continue
        # One port per fabric lists every subnet manager on it.
        asked.add(sm.guid)
        sms = run_tool(["saquery", "-s", "-C", p.hca, "-P", str(p.port)], root=root, timeout=TOOL_TIMEOUT)
        if sms.ok:
            found["sms"] = subnet.parse_saquery_sms(sms.stdout)[:64]
        else:
            found["sms_error"] = sms.error
    return out


def _kernel_xids(root: Path | None) -> list[health.KernelXid]:
    res = run_tool(["dmesg"], root=root, timeout=TOOL_TIMEOUT)
    return health.parse_kernel_xids(res.stdout) if res.ok else []


def _slow_key(readings: list[GPUReading], ports: list[wire.IBPort]) -> tuple[Any, ...]:
    """What the slow reads depend on: cards or none, and each active IB port with its link-down count."""
    return (bool(readings), tuple((p.hca, p.port, p.counters.get("link_downed")) for p in _sm_ports(ports)))


def _slow_reads(
    root: Path | None, readings: list[GPUReading], ports: list[wire.IBPort], previous: Sample | None, at: float
) -> SlowReads:
    """The previous slow results while they are fresh and read for the same ports, else new ones."""
    key = _slow_key(readings, ports)
    last = previous.slow if previous is not None else None
    if last is not None and last.key == key and last.at <= at < last.at + SLOW_READ_INTERVAL:
        return last
    imex_state, imex_problems = read_imex(root)
    return SlowReads(
        at=at,
        key=key,
        xids=_kernel_xids(root) if readings else [],
        subnet=_subnet_managers(root, ports),
        imex=imex_state,
        imex_problems=imex_problems,
    )


def _load(root: Path | None, previous: Sample | None) -> tuple[wire.Load, tuple[int, int] | None]:
    l1, l5, l15 = host.parse_loadavg(read_text(root, "/proc/loadavg") or "")
    mem = host.parse_meminfo(read_text(root, "/proc/meminfo") or "")
    jiffies = host.parse_proc_stat(read_text(root, "/proc/stat") or "")
    cpus = host.cpu_count(root) or 0
    pct = 0.0
    if jiffies and previous and previous.cpu_jiffies:
        busy, total = jiffies[0] - previous.cpu_jiffies[0], jiffies[1] - previous.cpu_jiffies[1]
        pct = round(100.0 * busy / total, 1) if total > 0 else 0.0
    total_mem = mem.get("MemTotal", 0)
    avail = mem.get("MemAvailable", 0)
    load = wire.Load(
        cpu_percent=max(pct, 0.0),
        cpu_count=cpus,
        load1=l1,
        load5=l5,
        load15=l15,
        mem_used_bytes=max(total_mem - avail, 0),
        mem_avail_bytes=avail,
    )
    return load, jiffies


def sample(*, root: Path | None, previous: Sample | None = None, now: float | None = None) -> Sample:
    """One heartbeat's worth: load, GPU sensors and wear, IB ports, IMEX.

    The sensors, sysfs port states and counters and the load are read every
    time. XIDs, each port's subnet managers and IMEX are read on the first
    sample and then at most once a SLOW_READ_INTERVAL, or at once when the
    node's cards or active InfiniBand ports change (`SlowReads`); in between
    they are `previous`'s, so every sample carries every field.
    """
    root = Path(root) if root is not None else None
    at = time.time() if now is None else now
    problems: list[str] = []
    readings, _driver, gpu_problems = _readings(root)
    problems += gpu_problems
    ports = _ib_ports(root, problems)
    slow = _slow_reads(root, readings, ports, previous, at)
    for p in ports:
        found = slow.subnet.get((p.hca, p.port), {})
        for name in _SM_FIELDS:
            if name in found:
                value = found[name]
                setattr(p, name, list(value) if isinstance(value, list) else value)
    sensors: list[wire.GPUSensor] = []
    replays: dict[int, int] = {}
    for r in readings:
        s = to_sensor(r)
        replays[r.index] = r.pcie_replays
        if previous and r.pcie_replays >= 0 and r.index in previous.pcie_replays and at > previous.at:
            before = previous.pcie_replays[r.index]
            if before >= 0:
                rate = (r.pcie_replays - before) * 60.0 / (at - previous.at)
                s.problems += health.wear_problems(
                    remap_failure=False,
                    remap_pending=False,
                    retire_pending=False,
                    retired_pages=0,
                    replays_per_minute=rate,
                )
        card_xids = [x for x in slow.xids if health.same_pci(x.pci_bus_id, r.pci_bus_id)]
        if s.wear is not None and card_xids:
            last = card_xids[-1]
            s.wear.xid_errors = len(card_xids)
            s.wear.last_xid = last.xid
            s.wear.last_xid_text = health.xid_meaning(last.xid)
            fatal = [x for x in card_xids if health.xid_is_fatal(x.xid)]
            if fatal:
                s.problems.append(f"XID {fatal[-1].xid}: {health.xid_meaning(fatal[-1].xid)}")
        sensors.append(s)
    problems += slow.imex_problems
    load, jiffies = _load(root, previous)
    return Sample(
        load=load,
        gpus=sensors,
        ib_ports=ports,
        imex=slow.imex,
        problems=problems,
        at=at,
        cpu_jiffies=jiffies,
        pcie_replays=replays,
        slow=slow,
    )


def ibnetdiscover(*, hca: str, port: int, timeout: float, root: Path | None) -> ToolResult:
    """The fabric map seen from one port, for a ScanFabric command."""
    return run_tool(["ibnetdiscover", "-C", hca, "-P", str(port)], root=root, timeout=timeout)
