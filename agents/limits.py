"""Where the wire schema allows more than the inventory's columns hold.

The wire bounds are the protocol's; a few columns are narrower (a compute
capability is a handful of characters). A value that would not fit is refused
with its field path, like any other bad input, instead of failing in the
database halfway through a request.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import llmgw_wire as wire
from inventory import fabric as fabric_rules
from inventory import gpus as gpu_rules
from inventory.models import GPU, EngineInstall, FabricScan, LocalWeights, Node, SMChange, Storage

INT32 = 2**31 - 1


@cache
def _max(model, field: str) -> int:
    # Once per column and process: every heartbeat asks.
    return model._meta.get_field(field).max_length


def _long(path: str, value: str, limit: int, out: list[dict]) -> None:
    if len(value) > limit:
        out.append({"field": path, "problem": f"String should have at most {limit} characters"})


def _big(path: str, value: int | None, limit: int, out: list[dict]) -> None:
    if value is not None and value > limit:
        out.append({"field": path, "problem": f"Input should be less than or equal to {limit}"})


def _fabric(path: str, f: wire.GPUFabric | None, out: list[dict]) -> None:
    if f is None:
        return
    _long(f"{path}.state", f.state, _max(GPU, "fabric_state"), out)
    _long(f"{path}.status", f.status, _max(GPU, "fabric_status"), out)
    _long(f"{path}.cluster_uuid", f.cluster_uuid, _max(GPU, "cluster_uuid"), out)
    _long(f"{path}.clique_id", f.clique_id, _max(GPU, "clique_id"), out)
    _long(f"{path}.bandwidth", f.bandwidth, _max(GPU, "fabric_bandwidth"), out)
    _long(f"{path}.health", f.health, _max(GPU, "fabric_health"), out)
    # The node's domain is "<cluster>/<clique>".
    if len(f.cluster_uuid) + 1 + len(f.clique_id) > _max(Node, "nvlink_domain"):
        out.append({"field": f"{path}.cluster_uuid", "problem": "cluster UUID and clique id together are too long"})


def _installs(path: str, installs: Iterable[wire.EngineInstall] | None, out: list[dict]) -> None:
    for i, e in enumerate(installs or []):
        _long(f"{path}.{i}.engine", e.engine, _max(EngineInstall, "engine"), out)


def _imex(path: str, imex: wire.IMEX | None, out: list[dict]) -> None:
    if imex is not None:
        _long(f"{path}.state", imex.state, _max(Node, "imex_state"), out)
        _big(f"{path}.channels", imex.channels, INT32, out)


def register_problems(reg: wire.Register) -> list[dict]:
    """The fields of a registration the inventory cannot hold."""
    out: list[dict] = []
    if reg.host is not None:
        _long("host.arch", reg.host.arch, _max(Node, "arch"), out)
        _long("host.nvidia_driver", reg.host.nvidia_driver, _max(Node, "nvidia_driver"), out)
    for i, g in enumerate(reg.gpus):
        p = f"gpus.{i}"
        _long(f"{p}.compute_capability", g.compute_capability, _max(GPU, "compute_capability"), out)
        _long(f"{p}.pci_bus_id", g.pci_bus_id, _max(GPU, "pci_bus_id"), out)
        _long(f"{p}.driver_version", g.driver_version, _max(GPU, "driver_version"), out)
        _long(f"{p}.cuda_version", g.cuda_version, _max(GPU, "cuda_version"), out)
        if len(gpu_rules.gpu_class(g.name, g.memory_total_mb)) > _max(GPU, "gpu_class"):
            out.append({"field": f"{p}.name", "problem": "too long to name a GPU class"})
        _big(f"{p}.memory_total_mb", g.memory_total_mb, INT32, out)
        _big(f"{p}.memory_used_mb", g.memory_used_mb, INT32, out)
        _big(f"{p}.ecc_errors", g.ecc_errors, INT32, out)
        _fabric(f"{p}.fabric", g.fabric, out)
    for i, s in enumerate(reg.storage or []):
        _long(f"storage.{i}.path", s.path, _max(Storage, "path"), out)
        _long(f"storage.{i}.fstype", s.fstype, _max(Storage, "fstype"), out)
    for i, w in enumerate(reg.weights or []):
        _long(f"weights.{i}.path", w.path, _max(LocalWeights, "path"), out)
    _installs("engine_installs", reg.engine_installs, out)
    _imex("imex", reg.imex, out)
    return out


def heartbeat_problems(hb: wire.Heartbeat) -> list[dict]:
    """The fields of a heartbeat the inventory cannot hold."""
    out: list[dict] = []
    for i, r in enumerate(hb.gpu_fabrics or []):
        _fabric(f"gpu_fabrics.{i}.fabric", r.fabric, out)
    _installs("engine_installs", hb.engine_installs, out)
    _imex("imex", hb.imex, out)
    port_len = _max(SMChange, "port")
    guid_len = _max(SMChange, "to_guid")
    for i, p in enumerate(hb.ib_ports or []):
        if len(p.hca) + 4 > port_len:  # "/" and a port number of at most 3 digits (wire.IBPort)
            _long(f"ib_ports.{i}.hca", f"{p.hca}/{p.port}", port_len, out)
        # Spelling a GUID canonically adds at most its "0x", or pads it to 18 characters.
        if len(p.sm_guid) + 2 > guid_len or guid_len < 18:
            _long(f"ib_ports.{i}.sm_guid", fabric_rules.canonical_guid(p.sm_guid), guid_len, out)
    return out


def scan_problems(scan: wire.ScanUpload) -> list[dict]:
    """The fields of a scan upload the inventory cannot hold."""
    out: list[dict] = []
    _long("hca", f"{scan.hca}/{scan.port}", _max(FabricScan, "port"), out)
    return out
