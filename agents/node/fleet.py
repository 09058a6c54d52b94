"""A fleet of virtual nodes in one process: thousands of agents on asyncio, speaking the real protocol.

A real agent process costs about 44 MB, so two hundred of them fill a
machine; a virtual node here costs a few kilobytes. Each one registers with a
join token at the real /api/v1/agent/register, keeps the credential it is
given (in memory), and heartbeats at the interval the control plane asks for,
with jitter, over a few shared keep-alive connections (`Connection`: HTTP/1.1
on asyncio streams; httpx's AsyncClient cost the fleet about 2.5 ms of CPU a
request, as much as the control plane spent answering it). Its registration
and heartbeats are what the agent's own discovery reads from a recorded hardware profile (agents/node/profiles/),
read once per profile and then varied per node: node id, host name,
management address, GPU UUIDs, adapter GUIDs and, for trays joined to a
multi-node NVLink domain, the domain (`domain_size` trays each).

StartShard and StopShard are answered with simulated shards: no engine
process, only states (starting, then loading, then ready after
`load_s`/`ready_s`) reported in the heartbeats as the supervisor reports real
ones. Commands are applied once by id and acknowledged in the next heartbeat,
as the agent does. Failures on demand, per node: silence (nothing sent), lost
answers (the heartbeat reaches the control plane, its answer never reaches the
node), a card falling off the bus (XID 79 on the card, as the kernel log says
it), an adapter's port going down.

`python -m agents.node.fleet --control-plane URL --join-token-file F --nodes N`
runs one (no Django needed); `--control FILE` (JSON, re-read every half
second) sets the failures from outside, `--stats FILE` is rewritten every
half second with counts and latency histograms.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import copy
import json
import logging
import os
import random
import re
import signal
import ssl
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import wire
from agents.node.loop import AGENT_VERSION, FABRIC_EVERY_S, backoff_delay
from agents.node.simulate import NS, PROFILES_DIR, ZERO_UUID, derive_fabrics, shipped_profiles
from agents.node.status import STATUS_FLOOR_S

log = logging.getLogger("llmgw.fleet")

S = wire.ShardState
FEATURES = ["adoption", "gpu-fabrics", "simulated"]
# A stopped or failed shard is still reported for this many heartbeats, so the
# control plane sees how it ended even when one answer is lost.
TERMINAL_REPORTS = 3
# Latency histogram: bucket upper edges in seconds, 0.1 ms to 60 s, about 5% apart.
EDGES: list[float] = []
_e = 0.0001
while _e < 60.0:
    EDGES.append(round(_e, 7))
    _e *= 1.05
EDGES.append(float("inf"))
_PLACEHOLDER = re.compile(r'"@(\w+)@"')
XID_OFF_BUS = 79
XID_OFF_BUS_TEXT = "GPU has fallen off the bus: reboot the node"


def histogram_percentile(counts: list[int], p: float) -> float:
    """The `p`th percentile (0-100) of a histogram over EDGES: the upper edge of the bucket it falls in."""
    total = sum(counts)
    if not total:
        return 0.0
    rank = p / 100 * total
    seen = 0
    for edge, n in zip(EDGES, counts, strict=True):
        seen += n
        if seen >= rank and n:
            return edge
    return EDGES[-1]


def _guid(original: str, index: int) -> str:
    """An adapter GUID of virtual node `index`: the vendor's upper half kept, the lower half the node's own."""
    if not original.startswith("0x") or len(original) != 18:
        return original
    return f"{original[:10]}{(int(original[10:], 16) ^ (index * 2654435761)) & 0xFFFFFFFF:08x}"


class TransportError(Exception):
    """The control plane did not answer (refused, reset, timed out, or an answer that is not HTTP)."""


@dataclass
class Answer:
    """An HTTP answer: its status and body."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.content)


class Connection:
    """One keep-alive HTTP/1.1 connection to the control plane, opened on first use and after a failure.

    Only what the agent endpoints need: POST with a JSON body, answers with
    Content-Length or chunked. One request at a time (the fleet hands each
    connection to one node at a time).
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        self.authority = parts.netloc
        self.timeout_s = timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, token: str) -> Answer:
        """POST `body` to `path`; raises TransportError when no answer comes."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._post(path, body, token)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            self.close()
            raise TransportError(f"{self.authority}{path}: {type(e).__name__}: {e}") from e

    async def _post(self, path: str, body: bytes, token: str) -> Answer:
        if self.writer is None:
            ctx = ssl.create_default_context() if self.https else None
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, ssl=ctx)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get("transfer-encoding") == "chunked":
            content = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                content += chunk[:-2]
        else:
            content = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        return Answer(status, content)

    def close(self) -> None:
        """Drop the connection; the next request opens a new one."""
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


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
        from agents.node import discovery

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


@dataclass
class Stats:
    """What the fleet has done so far; cumulative, so two snapshots give the rates between them."""

    registered: int = 0
    register_refused: Counter = field(default_factory=Counter)
    heartbeats: int = 0
    # Of the heartbeats, those sent as leases (wire.Lease) rather than the whole status.
    leases: int = 0
    heartbeat_errors: Counter = field(default_factory=Counter)
    unreachable: int = 0
    answers_dropped: int = 0
    commands: Counter = field(default_factory=Counter)
    latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))
    register_latency: list[int] = field(default_factory=lambda: [0] * len(EDGES))

    def observe(self, hist: list[int], seconds: float) -> None:
        """Count one request's latency."""
        hist[bisect.bisect_left(EDGES, seconds)] += 1

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "registered": self.registered,
            "register_refused": dict(self.register_refused),
            "heartbeats": self.heartbeats,
            "leases": self.leases,
            "heartbeat_errors": dict(self.heartbeat_errors),
            "unreachable": self.unreachable,
            "answers_dropped": self.answers_dropped,
            "commands": dict(self.commands),
            "latency": list(self.latency),
            "register_latency": list(self.register_latency),
        }


class VirtualNode:
    """One node of the fleet: its identity, credential, shards, pending acks and faults."""

    __slots__ = (
        "acks",
        "applied",
        "credential",
        "domain",
        "faults",
        "fleet",
        "index",
        "interval",
        "last_fabrics",
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
        self.mgmt_addr = f"10.{100 + index // 65536 % 100}.{index // 256 % 256}.{index % 256}"
        self.credential = ""
        self.registered = False
        self.interval = fleet.interval
        self.shards: dict[str, SimShard] = {}
        self.applied: dict[str, None] = {}
        self.acks: dict[str, None] = {}
        self.faults = Faults()
        self.last_fabrics = 0.0
        self.tick = 0
        # Leases between statuses (agents/node/status.py): whether the control plane takes them, and
        # the last status it accepted (when, and what it said that can change here), None to send one.
        self.leases = False
        self.status: tuple[float, Any] | None = None

    # --- what it says -----------------------------------------------------

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

    def status_key(self, now: float) -> Any:
        """What a simulated node's status says that can change: its sensors are its profile's, steady,
        and its counters grow at a steady rate, so its shards' states and its faults."""
        shards = tuple((s.shard_id, self.fleet.shard_state(s, now)) for s in self.shards.values())
        return shards, frozenset(self.faults.cards_off), frozenset(self.faults.ports_down)

    def lease(self, now: float) -> tuple[bytes, list[str]] | None:
        """A lease instead of the status, None when the status must go (as StatusGate decides for an agent)."""
        if not self.leases or self.status is None or now - self.status[0] >= STATUS_FLOOR_S:
            return None
        if self.status[1] != self.status_key(now):
            return None
        acks = list(self.acks)[: wire.MAX_COMMANDS]
        return json.dumps({"node_id": self.node_id, "at": now, "acks": acks}).encode(), acks

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

    # --- what it does -----------------------------------------------------

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


class Fleet:
    """Virtual nodes over the recorded profiles, run on one asyncio loop against one control plane."""

    def __init__(
        self,
        *,
        control_plane: str,
        join_token: str,
        nodes: int,
        first: int = 0,
        profiles: list[str] | None = None,
        prefix: str = "fleet",
        interval: float = 5.0,
        jitter: float = 0.1,
        ramp_s: float = 0.0,
        domain_size: int = 18,
        load_s: float = 0.5,
        ready_s: float = 1.5,
        connections: int = 64,
        timeout_s: float = 30.0,
        labels: dict[str, str] | None = None,
        seed: int | None = None,
        profiles_dir: Path = PROFILES_DIR,
    ) -> None:
        names = profiles or shipped_profiles()
        if not names:
            raise ValueError(f"no node profiles in {profiles_dir}")
        self.control_plane = control_plane
        self.join_token = join_token
        self.prefix = prefix
        self.interval = interval
        self.jitter = jitter
        self.ramp_s = ramp_s
        self.load_s, self.ready_s = load_s, ready_s
        self.connections = connections
        self.timeout_s = timeout_s
        self.labels = dict(labels or {})
        self.rng = random.Random(seed)
        self.clock = time.time
        self.stats = Stats()
        self.profiles = {n: ProfileTemplate.read(n, profiles_dir=profiles_dir) for n in names}
        self.templates = {n: self._template(p) for n, p in self.profiles.items()}
        self.nodes: list[VirtualNode] = []
        self.identities: dict[int, dict[str, str]] = {}
        for i in range(first, first + nodes):
            p = self.profiles[names[i % len(names)]]
            # The node's number among the nodes of its profile, from its global index alone, so
            # several processes sharing one fleet's numbering fill the same domains.
            ordinal = (i // len(names)) * names.count(p.name) + names[: i % len(names)].count(p.name)
            domain = str(uuid.uuid5(NS, f"domain/{p.name}/{ordinal // max(1, domain_size)}")) if p.in_domain else ""
            self.nodes.append(VirtualNode(self, i, p, domain))
        self.by_id = {n.node_id: n for n in self.nodes}
        self._stop: asyncio.Event | None = None
        self._connections: asyncio.Queue[Connection] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def _template(p: ProfileTemplate) -> str:
        """The profile's heartbeat as a %-format string: node id, clock, shards, acks and counters fill in."""
        hb = copy.deepcopy(p.heartbeat)
        hb.update(node_id="@node@", at="@at@", shards="@shards@", acks="@acks@")
        for i, port in enumerate(hb.get("ib_ports") or []):
            port.setdefault("counters", {}).update(port_xmit_data=f"@tx{i}@", port_rcv_data=f"@rx{i}@")
            port.update(node_guid=f"@ng{i}@", port_guid=f"@pg{i}@")
        return _PLACEHOLDER.sub(r"%(\1)s", json.dumps(hb).replace("%", "%%"))

    def shard_state(self, s: SimShard, now: float) -> wire.ShardState:
        """A simulated shard's state now."""
        return s.state(now, load_s=self.load_s, ready_s=self.ready_s)

    # --- failures on demand -----------------------------------------------

    def silence(self, node_ids: Iterable[str], on: bool = True) -> None:
        """Stop (or resume) every request from these nodes, as a node powered off or cut from the network."""
        for n in node_ids:
            self.by_id[n].faults.silent = on

    def lose_answers(self, node_ids: Iterable[str], on: bool = True) -> None:
        """Heartbeats still arrive, their answers are lost on the way back (commands never reach the node)."""
        for n in node_ids:
            self.by_id[n].faults.lose_answers = on

    def card_off(self, node_id: str, index: int, *, reregister: bool = True) -> None:
        """A card falls off the bus (XID 79); with `reregister` the node registers again, as a restarted agent would."""
        node = self.by_id[node_id]
        node.faults.cards_off.add(index)
        if reregister:
            node.registered = False

    def port_down(self, node_id: str, hca: str, down: bool = True) -> None:
        """An adapter's port goes down (cable pulled) or comes back."""
        ports = self.by_id[node_id].faults.ports_down
        if down:
            ports.add(hca)
        else:
            ports.discard(hca)

    def apply_control(self, control: dict[str, Any]) -> None:
        """Set every node's faults from a control document (the `--control` file): the whole desired state."""
        silent = set(control.get("silence") or [])
        lost = set(control.get("lose_answers") or [])
        cards = {k: set(v) for k, v in (control.get("cards_off") or {}).items()}
        ports = {k: set(v) for k, v in (control.get("ports_down") or {}).items()}
        for n in self.nodes:
            f = n.faults
            f.silent = n.node_id in silent
            f.lose_answers = n.node_id in lost
            want = cards.get(n.node_id, set())
            if want - f.cards_off:
                n.registered = False
            f.cards_off = want
            f.ports_down = ports.get(n.node_id, set())

    # --- running ------------------------------------------------------------

    async def _post(self, path: str, body: bytes, token: str) -> Answer:
        """POST on one of the fleet's connections, waiting for a free one (a node at a time on each)."""
        assert self._connections is not None
        conn = await self._connections.get()
        try:
            return await conn.post(path, body, token)
        finally:
            self._connections.put_nowait(conn)

    async def _register(self, node: VirtualNode) -> bool:
        """Register with the node's credential, or the join token when it has none or it was refused."""
        body = node.registration()
        t0 = time.perf_counter()
        r = None
        if node.credential:
            r = await self._post("/api/v1/agent/register", body, node.credential)
            if r.status_code in (401, 403):
                node.credential, r = "", None
        if r is None:
            r = await self._post("/api/v1/agent/register", body, self.join_token)
        self.stats.observe(self.stats.register_latency, time.perf_counter() - t0)
        if r.status_code != 200:
            self.stats.register_refused[str(r.status_code)] += 1
            return False
        answer = r.json()
        if answer.get("credential"):
            node.credential = answer["credential"]
        node.interval = max(self.interval, min(600.0, float(answer.get("heartbeat_interval_s") or 0)))
        node.registered = True
        node.leases, node.status = False, None
        node.last_fabrics = self.clock()
        self.stats.registered += 1
        now = self.clock()
        for cmd in answer.get("commands") or []:
            node.apply(cmd, now)
        return True

    async def _heartbeat(self, node: VirtualNode) -> bool:
        now = self.clock()
        leased = node.lease(now)
        key = None if leased else node.status_key(now)
        body, acks = leased or node.heartbeat(now)
        t0 = time.perf_counter()
        r = await self._post(wire.LEASE_PATH if leased else "/api/v1/agent/heartbeat", body, node.credential)
        if r.status_code in (401, 403, 404):
            node.registered = False
            self.stats.heartbeat_errors[str(r.status_code)] += 1
            return False
        if r.status_code != 200:
            self.stats.heartbeat_errors[str(r.status_code)] += 1
            return r.status_code < 500
        self.stats.observe(self.stats.latency, time.perf_counter() - t0)
        self.stats.heartbeats += 1
        if node.faults.lose_answers:
            self.stats.answers_dropped += 1
            return True
        for a in acks:
            node.acks.pop(a, None)
        answer = r.json()
        if leased:
            self.stats.leases += 1
            if answer.get("send_status"):
                node.status = None
        else:
            node.leases, node.status = bool(answer.get("leases")), (now, key)
        node.interval = max(self.interval, min(600.0, float(answer.get("heartbeat_interval_s") or 0)))
        now = self.clock()
        for cmd in answer.get("commands") or []:
            node.apply(cmd, now)
        return True

    async def _run_node(self, node: VirtualNode) -> None:
        """One node's life: register, heartbeat with jitter, back off while the control plane is away."""
        rng = random.Random(self.rng.random())
        if self.ramp_s:
            await asyncio.sleep(rng.random() * self.ramp_s)
        failures = 0
        while True:
            delay = node.interval * (1 + self.jitter * (2 * rng.random() - 1))
            if node.faults.silent:
                await asyncio.sleep(min(delay, 0.5))
                continue
            try:
                ok = await self._register(node) if not node.registered else True
                if ok and node.registered:
                    ok = await self._heartbeat(node)
            except (TransportError, ValueError) as e:
                self.stats.unreachable += 1
                log.debug("%s: %s", node.node_id, e)
                ok = False
            if ok:
                failures = 0
            else:
                failures += 1
                delay = backoff_delay(failures, rng)
            await asyncio.sleep(delay)

    async def _watch(self, control: Path | None, stats: Path | None) -> None:
        """Re-read the control file and rewrite the stats file while the fleet runs."""
        seen = None
        while True:
            if control is not None:
                with contextlib.suppress(OSError, ValueError):
                    stamp = control.stat().st_mtime_ns
                    if stamp != seen:
                        self.apply_control(json.loads(control.read_text()))
                        seen = stamp
            if stats is not None:
                self.write_stats(stats)
            await asyncio.sleep(0.5)

    def write_stats(self, path: Path) -> None:
        """Rewrite the stats file atomically."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"at": self.clock(), "nodes": len(self.nodes), **self.stats.as_dict()}))
        os.replace(tmp, path)

    async def run(self, *, control: Path | None = None, stats: Path | None = None) -> None:
        """Run every node until stop() is called."""
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        conns = [Connection(self.control_plane, timeout_s=self.timeout_s) for _ in range(self.connections)]
        self._connections = asyncio.Queue()
        for c in conns:
            self._connections.put_nowait(c)
        tasks = [asyncio.create_task(self._run_node(n)) for n in self.nodes]
        tasks.append(asyncio.create_task(self._watch(control, stats)))
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in conns:
                c.close()
            if stats is not None:
                self.write_stats(stats)

    def stop(self) -> None:
        """Ask every node to stop (thread-safe)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def start_in_thread(self) -> None:
        """Run the fleet on its own event loop in a background thread (for tests and embedding)."""
        started = threading.Event()

        async def go() -> None:
            task = asyncio.create_task(self.run())
            await asyncio.sleep(0)
            started.set()
            await task

        self._thread = threading.Thread(target=asyncio.run, args=(go(),), name="fleet", daemon=True)
        self._thread.start()
        started.wait(30)

    def join(self, timeout: float = 30.0) -> None:
        """Stop the fleet and wait for its thread to end."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m agents.node.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--control-plane", required=True, help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--join-token-file", required=True, help="file holding the join token")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--first", type=int, default=0, help="number of the first node (several processes share a fleet)")
    ap.add_argument("--profiles", default="", help="comma-separated profile names (default: all shipped)")
    ap.add_argument("--prefix", default="fleet", help="node ids are PREFIX-PROFILE-NNNNN")
    ap.add_argument("--interval", type=float, default=5.0, help="heartbeat seconds (the control plane's if longer)")
    ap.add_argument("--jitter", type=float, default=0.1, help="each interval varies by up to this fraction")
    ap.add_argument("--ramp", type=float, default=0.0, help="nodes start spread over this many seconds")
    ap.add_argument("--domain-size", type=int, default=18, help="trays per multi-node NVLink domain")
    ap.add_argument("--load-s", type=float, default=0.5, help="a started shard is loading after this")
    ap.add_argument("--ready-s", type=float, default=1.5, help="a started shard is ready after this")
    ap.add_argument("--connections", type=int, default=64, help="keep-alive connections to the control plane")
    ap.add_argument("--control", help="JSON file of failures to show (re-read when it changes)")
    ap.add_argument("--stats", help="JSON file rewritten every half second with counts and latencies")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run a fleet until SIGTERM or SIGINT."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = Path(args.join_token_file).read_text().strip()
    fleet = Fleet(
        control_plane=args.control_plane,
        join_token=token,
        nodes=args.nodes,
        first=args.first,
        profiles=[p for p in args.profiles.split(",") if p] or None,
        prefix=args.prefix,
        interval=args.interval,
        jitter=args.jitter,
        ramp_s=args.ramp,
        domain_size=args.domain_size,
        load_s=args.load_s,
        ready_s=args.ready_s,
        connections=args.connections,
    )

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, fleet.stop)
        await fleet.run(
            control=Path(args.control) if args.control else None, stats=Path(args.stats) if args.stats else None
        )

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main())
