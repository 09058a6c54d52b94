"""One virtual node of the fleet: its identity, the registration and heartbeats it sends, and the commands it answers.

What it says is what the agent's own discovery reads from a recorded hardware
profile, read once per profile (ProfileTemplate) and varied per node.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llmgw_wire as wire
from llmgw_agent import discovery
from llmgw_agent.loop import AGENT_VERSION, FABRIC_EVERY_S
from llmgw_agent.status import STATUS_FLOOR_S
from llmgw_sim.simulate import NS, PROFILES_DIR, ZERO_UUID, derive_fabrics
from llmgw_wire.shard_states import STARTING_UP

if TYPE_CHECKING:
    from llmgw_sim.fleet import Fleet


log = logging.getLogger("llmgw.fleet")

S = wire.ShardState
FEATURES = ["adoption", "gpu-fabrics", "simulated"]
# A stopped or failed shard is still reported for this many heartbeats, so the
# control plane sees how it ended even when one answer is lost.
TERMINAL_REPORTS = 3
# A value of a heartbeat template ("@name@", JSON-quoted) that each node fills in with its own.
PLACEHOLDER = re.compile(r'"@(\w+)@"')
XID_OFF_BUS = 79
XID_OFF_BUS_TEXT = "GPU has fallen off the bus: reboot the node"


def _guid(original: str, index: int) -> str:
    """An adapter GUID of virtual node `index`: the vendor's upper half kept, the lower half the node's own."""
    if not original.startswith("0x") or len(original) != 18:
        return original
    return f"{original[:10]}{(int(original[10:], 16) ^ (index * 2654435761)) & 0xFFFFFFFF:08x}"


@dataclass
class ProfileTemplate:
    """One recorded hardware profile as the agent's own discovery reads it, before any node is made of it."""

    name: str
    registration: dict[str, Any]
    heartbeat: dict[str, Any]
    gpu_fabrics: list[dict[str, Any]]
    fabrics: list[dict[str, Any]]
    in_domain: bool

    @classmethod
    def read(cls, name: str, *, profiles_dir: Path = PROFILES_DIR) -> ProfileTemplate:
        """Run discovery once over the recorded profile: the registration, a sample and the GPUs' fabrics."""
        root = profiles_dir / name
        found = discovery.discover(root=root, model_dirs=[])
        sampled = discovery.sample(root=root)
        reg = wire.Register(
            node_id="template",
            agent_version=AGENT_VERSION,
            features=FEATURES,
            engine_versions=found.engine_versions,
            engines_probed=found.engines_probed,
            memory_total_mb=found.memory_total_mb,
            cpu_count=found.cpu_count,
            host=found.host,
            gpus=found.gpus,
            storage=found.storage,
            weights=found.weights,
            imex=found.imex,
        )
        hb = wire.Heartbeat(
            node_id="template", load=sampled.load, gpus=sampled.gpus, ib_ports=sampled.ib_ports, imex=sampled.imex
        )
        fabrics = [wire.GPUFabricReport(index=g.index, fabric=g.fabric) for g in found.gpus]
        in_domain = any(g.fabric is not None and g.fabric.cluster_uuid not in ("", ZERO_UUID) for g in found.gpus)
        return cls(
            name=name,
            registration=reg.model_dump(mode="json", exclude_none=True),
            heartbeat=hb.model_dump(mode="json", exclude_none=True),
            gpu_fabrics=[f.model_dump(mode="json", exclude_none=True) for f in fabrics],
            fabrics=derive_fabrics(root),
            in_domain=in_domain,
        )


@dataclass
class SimShard:
    """A simulated shard: its state follows from when it was started, no process runs."""

    shard_id: str
    replica_id: str
    http_port: int | None
    gpu_indices: list[int]
    started: float
    stopped: float | None = None
    reports_left: int = TERMINAL_REPORTS

    def state(self, now: float, *, load_s: float, ready_s: float) -> wire.ShardState:
        """starting, then loading after `load_s`, ready after `ready_s`; stopped once stopped."""
        if self.stopped is not None:
            return S.STOPPED
        age = now - self.started
        if age >= ready_s:
            return S.READY
        return S.LOADING if age >= load_s else S.STARTING


@dataclass
class Faults:
    """The failures a virtual node shows now (set on demand)."""

    silent: bool = False
    lose_answers: bool = False
    cards_off: set[int] = field(default_factory=set)
    ports_down: set[str] = field(default_factory=set)

    def any_report(self) -> bool:
        """Whether the node's reports differ from its profile's (a card off, a port down)."""
        return bool(self.cards_off or self.ports_down)


class VirtualNode:
    """One node of the fleet: its identity, credential, shards, pending acks and faults."""

    __slots__ = (
        "acks",
        "again_run",
        "applied",
        "credential",
        "digest",
        "domain",
        "faults",
        "fleet",
        "index",
        "interval",
        "last_fabrics",
        "lease_fallback_until",
        "leases",
        "mgmt_addr",
        "node_id",
        "profile",
        "registered",
        "shards",
        "status",
        "tick",
    )  # fmt: skip

    def __init__(self, fleet: Fleet, index: int, profile: ProfileTemplate, domain: str) -> None:
        self.fleet = fleet
        self.index = index
        self.node_id = f"{fleet.prefix}-{profile.name}-{index:05d}"
        self.profile = profile
        self.domain = domain
        # A loopback address (all of 127.0.0.0/8 is this host's): a replica's endpoint is built from it, and a
        # gateway routing or scraping a simulated replica must reach this machine or nothing, never a
        # private network the simulation does not own (a 10.x address sent real SYNs out, and their
        # scrapes, left hanging, stalled the gateway's event loop).
        self.mgmt_addr = f"127.{100 + index // 65536 % 100}.{index // 256 % 256}.{index % 256}"
        self.credential = ""
        self.registered = False
        self.interval = fleet.interval
        self.shards: dict[str, SimShard] = {}
        self.applied: dict[str, None] = {}
        self.acks: dict[str, None] = {}
        self.faults = Faults()
        self.last_fabrics = 0.0
        self.tick = 0
        # Leases between statuses (llmgw_agent/status.py): whether the control plane takes them, and
        # the last status it accepted (when, and what it said that can change here), None to send one.
        self.leases = False
        # Until when (the fleet's clock) its leases go to the control plane's own endpoint: its last one
        # to the gateway failed (llmgw_agent/loop.py LEASE_FALLBACK_S).
        self.lease_fallback_until = 0.0
        self.status: tuple[float, Any] | None = None
        # The digest the control plane gave that status (its floor goes as a lease carrying it), None: none given.
        self.digest: str | None = None
        # Consecutive answers that said come back at once (an agent follows MAX_AGAIN of them).
        self.again_run = 0

    def _gpu_uuid(self, original: str) -> str:
        return "GPU-" + str(uuid.uuid5(NS, f"{self.node_id}/{original}")) if original else original

    def _fabric(self, f: dict[str, Any] | None) -> dict[str, Any] | None:
        if f is None or not self.domain or f.get("cluster_uuid") in (None, "", ZERO_UUID, "N/A"):
            return f
        return {**f, "cluster_uuid": self.domain}

    def registration(self) -> bytes:
        """The registration: the profile's inventory under this node's identity, and its live shards."""
        reg = copy.deepcopy(self.profile.registration)
        reg.update(
            node_id=self.node_id,
            hostname=f"{self.node_id}.sim",
            mgmt_addr=self.mgmt_addr,
            labels={"simulated": "true", "profile": self.profile.name, **self.fleet.labels},
            fabrics=self.profile.fabrics,
            at=self.fleet.clock(),
        )
        for g in reg.get("gpus", []):
            g["uuid"] = self._gpu_uuid(g.get("uuid", ""))
            g["fabric"] = self._fabric(g.get("fabric"))
            if g["index"] in self.faults.cards_off:
                g["problems"] = [*g.get("problems", []), f"XID {XID_OFF_BUS}: {XID_OFF_BUS_TEXT}"]
        now = self.fleet.clock()
        reg["running_shards"] = [
            {
                "replica_id": s.replica_id,
                "shard_id": s.shard_id,
                "gpu_indices": s.gpu_indices,
                "state": str(self.fleet.shard_state(s, now)),
                **({"http_port": s.http_port} if s.http_port else {}),
            }
            for s in self.shards.values()
            if s.stopped is None
        ]
        return json.dumps(reg).encode()

    def shard_report(self, now: float) -> list[dict[str, Any]]:
        """Every shard's state as the supervisor reports it; a stopped one for a few heartbeats more."""
        out = []
        for s in list(self.shards.values()):
            st = self.fleet.shard_state(s, now)
            report: dict[str, Any] = {"shard_id": s.shard_id, "replica_id": s.replica_id, "state": str(st)}
            if s.http_port:
                report["http_port"] = s.http_port
            out.append(report)
            if st == S.STOPPED:
                s.reports_left -= 1
                if s.reports_left <= 0:
                    del self.shards[s.shard_id]
        return out

    def heartbeat(self, now: float) -> tuple[bytes, list[str]]:
        """This heartbeat's body, and the acks it carries."""
        self.tick += 1
        acks = list(self.acks)[: wire.MAX_COMMANDS]
        fabrics = now - self.last_fabrics >= FABRIC_EVERY_S
        if fabrics:
            self.last_fabrics = now
        values = {
            **self._identity(),
            "at": repr(now),
            "shards": json.dumps(self.shard_report(now)) if self.shards else "[]",
            "acks": json.dumps(acks) if acks else "[]",
        }
        for i in range(len(self.profile.heartbeat.get("ib_ports") or [])):
            values[f"tx{i}"] = str((10**9 + i + self.index) * self.tick)
            values[f"rx{i}"] = str((2 * 10**9 + i + self.index) * self.tick)
        if self.faults.any_report() or (fabrics and self.profile.gpu_fabrics):
            return self._heartbeat_slow(values, fabrics), acks
        return (self.fleet.templates[self.profile.name] % values).encode(), acks

    def next_change(self, now: float) -> float | None:
        """When the next of its shards becomes ready, None if none will: the change an agent reports at once
        (a start's loading waits for the next heartbeat, llmgw_wire/shard_states.py report_at_once)."""
        ready_s = self.fleet.ready_s
        return min((t for s in self.shards.values() if s.stopped is None and (t := s.started + ready_s) > now),
                   default=None)  # fmt: skip

    def status_key(self, now: float) -> Any:
        """What a simulated node's status says that can change: its sensors are its profile's, steady,
        and its counters grow at a steady rate, so its shards' states and its faults.

        A shard still starting or loading is left out: as an agent's StatusGate, a start's
        progress goes with a lease (llmgw_agent/status.py shards_change)."""
        states = ((s.shard_id, self.fleet.shard_state(s, now)) for s in self.shards.values())
        shards = tuple((sid, st) for sid, st in states if st not in STARTING_UP)
        return shards, frozenset(self.faults.cards_off), frozenset(self.faults.ports_down)

    def status_due(self, now: float) -> str:
        """Why the status must go now rather than a lease ("" when a lease will do)."""
        if not self.leases:
            return "no leases" if self.status is not None else "first"
        if self.status is None:
            return "asked"
        if self.status[1] != self.status_key(now):
            return "changed"
        # Last, as an agent's StatusGate: "floor" says nothing else changed (a routine status).
        return "floor" if now - self.status[0] >= STATUS_FLOOR_S else ""

    def lease(self, now: float) -> tuple[bytes, list[str], bool] | None:
        """A lease instead of the status, None when the status must go (as StatusGate decides for an agent).

        With the lease, its acks and whether it is the status floor, sent as the digest of the last status.
        """
        why = self.status_due(now)
        acks = list(self.acks)[: wire.MAX_COMMANDS]
        if why == "floor" and self.digest is not None:
            self.fleet.stats.floor_digests += 1
            return self._lease_body(now, acks, digest=self.digest), acks, True
        if why:
            self.fleet.stats.statuses_why[why] += 1
            return None
        return self._lease_body(now, acks), acks, False

    def keepalive(self, now: float) -> bytes:
        """A lease sent while a status waits (llmgw_agent/keepalive.py): no acks, they ride in the status."""
        return self._lease_body(now, [])

    def _lease_body(self, now: float, acks: list[str], *, digest: str | None = None) -> bytes:
        # Spliced, not dumped: the node id is JSON-encoded once (_identity), only the clock and acks change.
        tail = ',"acks":' + json.dumps(acks) + "}" if acks else ',"acks":[]}'
        if digest is not None:
            tail = ',"status_digest":' + json.dumps(digest) + tail
        return ('{"node_id":' + self._identity()["node"] + ',"at":' + repr(now) + tail).encode()

    def _identity(self) -> dict[str, str]:
        """The heartbeat's values that never change for this node (JSON-encoded), made once."""
        ident = self.fleet.identities.get(self.index)
        if ident is None:
            ident = {"node": json.dumps(self.node_id)}
            for i, port in enumerate(self.profile.heartbeat.get("ib_ports") or []):
                ident[f"ng{i}"] = json.dumps(_guid(port.get("node_guid", ""), self.index))
                ident[f"pg{i}"] = json.dumps(_guid(port.get("port_guid", ""), self.index))
            self.fleet.identities[self.index] = ident
        return ident

    def _heartbeat_slow(self, values: dict[str, str], fabrics: bool) -> bytes:
        """A heartbeat built whole: the rare one with the GPUs' fabrics or with a fault to show."""
        hb = copy.deepcopy(self.profile.heartbeat)
        hb["node_id"] = self.node_id
        hb["at"] = float(values["at"])
        hb["shards"] = json.loads(values["shards"])
        hb["acks"] = json.loads(values["acks"])
        for i, p in enumerate(hb.get("ib_ports") or []):
            counters = p.setdefault("counters", {})
            counters["port_xmit_data"], counters["port_rcv_data"] = int(values[f"tx{i}"]), int(values[f"rx{i}"])
            p["node_guid"], p["port_guid"] = json.loads(values[f"ng{i}"]), json.loads(values[f"pg{i}"])
            if p["hca"] in self.faults.ports_down:
                # As sysfs reads a port whose cable was pulled: down, polling, no subnet manager.
                p.update(state="1: DOWN", phys_state="2: Polling", sm_guid="", sm_lid=0, sm_state="")
                p["sm_error"] = "port is not active"
                p["sms"] = []
                counters["link_downed"] = counters.get("link_downed", 0) + 1
        for g in hb.get("gpus") or []:
            if g["index"] in self.faults.cards_off:
                # What the agent reads of a card gone from the bus: no sensors, XID 79 in the kernel log.
                g.update(temp_c=0.0, power_w=0.0, util_percent=-1, mem_util_percent=-1, memory_used_mb=0.0)
                wear = g.setdefault("wear", {})
                wear.update(xid_errors=max(1, wear.get("xid_errors", 0)), last_xid=XID_OFF_BUS)
                wear["last_xid_text"] = XID_OFF_BUS_TEXT
                g["problems"] = [f"XID {XID_OFF_BUS}: {XID_OFF_BUS_TEXT}"]
        if fabrics:
            hb["gpu_fabrics"] = [{**f, "fabric": self._fabric(f.get("fabric"))} for f in self.profile.gpu_fabrics]
        return json.dumps(hb).encode()

    def apply(self, cmd: dict[str, Any], now: float) -> None:
        """Apply one command once by id; a repeated id is acknowledged again, not re-applied."""
        cid = cmd.get("id") or ""
        if cid and cid in self.applied:
            self.acks[cid] = None
            return
        kind = cmd.get("kind", "")
        if kind == "start_shard":
            old = self.shards.get(cmd["shard_id"])
            if old is None or old.stopped is not None:
                self.shards[cmd["shard_id"]] = SimShard(
                    shard_id=cmd["shard_id"],
                    replica_id=cmd.get("replica_id", ""),
                    http_port=cmd.get("http_port"),
                    gpu_indices=list(cmd.get("gpu_indices") or []),
                    started=now,
                )
        elif kind == "stop_shard":
            s = self.shards.get(cmd["shard_id"])
            if s is not None and s.stopped is None:
                s.stopped = now
        # scan_fabric and install_engine: a simulated node has no ibnetdiscover and installs nothing;
        # acknowledging them keeps the control plane from repeating them forever.
        self.fleet.stats.commands[kind] += 1
        if cid:
            self.applied[cid] = None
            self.acks[cid] = None
            if len(self.applied) > 2000:
                for k in list(self.applied)[:1000]:
                    del self.applied[k]
