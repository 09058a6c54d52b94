"""InfiniBand and RoCE ports from /sys/class/infiniband, and a RoCE port's IP network."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import llmgw_wire as wire

from .subnet import canonical_guid
from .tools import host_path

IB_CLASS = "/sys/class/infiniband"
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*Gb/sec")


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace").strip()
    except OSError:
        return ""


def parse_rate(text: str) -> int:
    """Gb/s from sysfs "200 Gb/sec (4X HDR)"; 0 when not known."""
    m = _RATE.search(text)
    return int(float(m.group(1))) if m else 0


def guid_from_sysfs(text: str) -> str:
    """A sysfs GUID ("ec0d:9a03:0043:1464") in the canonical 0x form."""
    return canonical_guid(text)


def split_gid(gid: str) -> tuple[str, str]:
    """A GID's subnet prefix and interface id (port GUID), canonical; empty when unset."""
    groups = gid.strip().split(":")
    if len(groups) != 8:
        return "", ""
    prefix = ":".join(groups[:4]).lower()
    iface = canonical_guid("".join(groups[4:]))
    if iface == "0x0000000000000000":
        return prefix, ""
    return prefix, iface


def _netdev(hca_dir: Path, port_dir: Path) -> str:
    ndev = _read(port_dir / "gid_attrs" / "ndevs" / "0")
    if ndev:
        return ndev
    try:
        names = sorted(p.name for p in (hca_dir / "device" / "net").iterdir())
    except OSError:
        return ""
    return names[0] if names else ""


def _counters(port_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        entries = sorted((port_dir / "counters").iterdir())
    except OSError:
        return out
    for p in entries:
        v = _read(p)
        if v.isdigit():
            out[p.name] = int(v)
    return out


def read_ports(root: Path | None) -> list[wire.IBPort]:
    """Every port of every HCA under /sys/class/infiniband, by HCA name and port number."""
    base = host_path(root, IB_CLASS)
    try:
        hcas = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
    out: list[wire.IBPort] = []
    for hca_dir in hcas:
        node_guid = guid_from_sysfs(_read(hca_dir / "node_guid"))
        try:
            ports = sorted((p for p in (hca_dir / "ports").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        except OSError:
            continue
        for port_dir in ports:
            prefix, port_guid = split_gid(_read(port_dir / "gids" / "0"))
            out.append(
                wire.IBPort(
                    hca=hca_dir.name,
                    port=int(port_dir.name),
                    state=_read(port_dir / "state"),
                    phys_state=_read(port_dir / "phys_state"),
                    rate_gbps=parse_rate(_read(port_dir / "rate")),
                    link_layer=_read(port_dir / "link_layer"),
                    counters=_counters(port_dir),
                    node_guid=node_guid,
                    port_guid=port_guid,
                    gid_prefix=prefix,
                    netdev=_netdev(hca_dir, port_dir),
                )
            )
    return out


def port_active(port: wire.IBPort) -> bool:
    """Whether sysfs says the port is up ("4: ACTIVE")."""
    return port.state.upper().endswith("ACTIVE")


def parse_ip_addr_json(text: str) -> dict[str, list[str]]:
    """`ip -j addr`: each interface's IPv4 networks ("10.0.0.0/24"), in the order listed."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return {}
    out: dict[str, list[str]] = {}
    for iface in data if isinstance(data, list) else []:
        name = iface.get("ifname", "") if isinstance(iface, dict) else ""
        if not name:
            continue
        for addr in iface.get("addr_info", []) or []:
            if addr.get("family") != "inet" or "local" not in addr or "prefixlen" not in addr:
                continue
            try:
                net = ipaddress.ip_interface(f"{addr['local']}/{addr['prefixlen']}").network
            except ValueError:
                continue
            out.setdefault(name, []).append(str(net))
    return out
