"""A fleet of virtual nodes in one process: thousands of agents on asyncio, speaking the real protocol.

A real agent process costs about 44 MB, so two hundred of them fill a
machine; a virtual node here costs a few kilobytes. Each one registers with a
join token at the real /api/v1/agent/register, keeps the credential it is
given (in memory), and heartbeats at the interval the control plane asks for,
with jitter, over a few shared keep-alive connections (`Connection`: HTTP/1.1
on asyncio streams; httpx's AsyncClient cost the fleet about 2.5 ms of CPU a
request, as much as the control plane spent answering it). Its registration
and heartbeats are what the agent's own discovery reads from a recorded hardware profile (llmgw_sim/profiles/),
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

`python -m llmgw_sim.fleet --control-plane URL --join-token-file F --nodes N`
runs one (no Django needed); `--control FILE` (JSON, re-read every half
second) sets the failures from outside, `--stats FILE` is rewritten every
half second with counts and latency histograms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import llmgw_wire as wire
from llmgw_wire.priority import ROUTINE, Lanes

try:
    import uvloop
except ImportError:  # a development tool: asyncio's own loop serves, at a higher CPU cost per heartbeat
    uvloop = None
from llmgw_agent.keepalive import AFTER_S as KEEPALIVE_AFTER_S
from llmgw_agent.loop import LEASE_FALLBACK_S, LEASE_TIMEOUT_S, backoff_delay
from llmgw_agent.status import MAX_AGAIN
from llmgw_sim.fleet_http import Answer, Connection, TransportError
from llmgw_sim.fleet_stats import EDGES, Stats, histogram_percentile
from llmgw_sim.simulate import NS, PROFILES_DIR, shipped_profiles
from llmgw_sim.virtual_node import (
    PLACEHOLDER,
    TERMINAL_REPORTS,
    XID_OFF_BUS,
    ProfileTemplate,
    SimShard,
    VirtualNode,
)

log = logging.getLogger("llmgw.fleet")

S = wire.ShardState
HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
# The header lines of a routine status, as an agent sends them.
_ROUTINE_HEAD = b"".join(f"\r\n{k}: {v}".encode() for k, v in ROUTINE.items())

# Part of this module's interface: bench/fleet.py and the tests take them from here.
__all__ = [
    "EDGES",
    "TERMINAL_REPORTS",
    "XID_OFF_BUS",
    "Connection",
    "Fleet",
    "ProfileTemplate",
    "TransportError",
    "histogram_percentile",
    "main",
]


def routine_share(connections: int) -> int:
    """How many of the fleet's `connections` to the control plane routine statuses may hold at once.

    Three quarters (one at least): the rest stay free for the statuses the web serves first.
    """
    return max(1, connections - connections // 4)


def run_loop(coro: Any) -> Any:
    """Run a coroutine to its end on a new event loop: uvloop's when installed (LLMGW_SIM_LOOP=asyncio: asyncio's).

    The fleet's own CPU per heartbeat is mostly the event loop's (a timer, a
    write, a read, a future per request); libuv's loop does that work in C.
    """
    if uvloop is not None and os.environ.get("LLMGW_SIM_LOOP", "uvloop") != "asyncio":
        return uvloop.run(coro)
    return asyncio.run(coro)


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
        keepalive: bool = True,
        priority: bool = True,
        floor_digests: bool = True,
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
        # Leases while a status waits, as an agent sends them (llmgw_agent/keepalive.py); off to measure without.
        self.keepalive = keepalive
        # Routine statuses marked so (llmgw_agent/status.py ROUTINE); off to measure the web's lanes without.
        self.priority = priority
        # Status floors sent as the digest of the last status (llmgw_agent/status.py); off to measure whole floors.
        self.floor_digests = floor_digests
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
        self._connections: Lanes[Connection] | None = None
        self._all_connections: list[Connection] = []
        # How many of the control plane's connections routine statuses may hold at once (_post).
        self._routine_slots: asyncio.Semaphore | None = None
        # Where the control plane takes leases in batches (its gateway's lease_url), as an agent learns it;
        # the fleet's connections there, opened on first use. Each node falls back to the control plane's
        # own endpoint on its own lease's failure (VirtualNode.lease_fallback_until), as an agent does.
        self.lease_url = ""
        self._lease_connections: Lanes[Connection] | None = None
        # Leases being sent while statuses wait (_status).
        self._keepalives: set[asyncio.Future] = set()
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
        return PLACEHOLDER.sub(r"%(\1)s", json.dumps(hb).replace("%", "%%"))

    def shard_state(self, s: SimShard, now: float) -> wire.ShardState:
        """A simulated shard's state now."""
        return s.state(now, load_s=self.load_s, ready_s=self.ready_s)

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

    def use_connections(self, conns: list[Connection]) -> None:
        """Send to the control plane over `conns`, shared by every node (a routine status may hold three quarters)."""
        self.connections = len(conns)
        self._all_connections = list(conns)
        self._connections = Lanes(conns)
        self._routine_slots = asyncio.Semaphore(routine_share(len(conns)))

    async def _post(
        self, path: str, body: bytes | Callable[[], bytes], token: str, *, extra: bytes = b"", routine: bool = False
    ) -> Answer:
        """POST on one of the fleet's connections, waiting for a free one (a node at a time on each).

        A `body` given as a function is built once the connection is free (see _heartbeat).
        """
        assert self._connections is not None and self._routine_slots is not None
        slots = self._routine_slots if routine else None
        conn = await self._take(self._connections, routine=routine, slots=slots)
        try:
            return await conn.post(path, body() if callable(body) else body, token, extra=extra)
        finally:
            self._connections.put_nowait(conn)
            if slots is not None:
                slots.release()

    async def _take(
        self, pool: Lanes[Connection], *, routine: bool = False, slots: asyncio.Semaphore | None = None
    ) -> Connection:
        """A free connection of `pool`; the wait is counted: a fleet of agents, a connection each, has none.

        An agent holds a connection of its own, so no node's request waits for another's. The fleet
        shares a few, and its own queue for them put a status reporting a shard ready behind a minute's
        routine statuses of other nodes, a delay no fleet of agents has: a routine request waits behind
        the others (llmgw_wire/priority.py Lanes). Nor may routine statuses hold every connection
        (`slots`, taken first and given back by the caller): the web serves them last, and a status
        reporting a shard ready waited for a connection one of them held until the web got to it.
        """
        if (slots is None or not slots.locked()) and not pool.empty():
            if slots is not None:
                await slots.acquire()  # free: taken without a wait
            self.stats.observe(self.stats.pool_wait, 0.0)
            return pool.get_nowait()
        t0 = time.perf_counter()
        if slots is not None:
            await slots.acquire()
        try:
            conn = await pool.get(routine=routine)
        except BaseException:
            if slots is not None:
                slots.release()
            raise
        self.stats.observe(self.stats.pool_wait, time.perf_counter() - t0)
        return conn

    async def _post_lease(self, node: VirtualNode, body: bytes) -> Answer:
        """A node's lease to the gateway the control plane named (lease_url), as an agent's (llmgw_agent/loop.py).

        To the control plane's own endpoint when none is named, and for a minute after this node's lease
        to the gateway failed. The node's alone, as an agent's: the fleet once sent every lease of its
        process to the web server for a minute after any one of them failed, and a gateway slow for two
        seconds during a scale-up put 2,500 nodes' leases on the web server at three times a lease's
        cost there, where the statuses reporting shards ready then waited seconds for a thread.
        """
        token = node.credential
        if not self.lease_url:
            return await self._post(wire.LEASE_PATH, body, token)
        if self.clock() < node.lease_fallback_until:
            return await self._lease_to_control_plane(body, token)
        t0 = time.perf_counter()
        r = await self._to_gateway(node, body)
        if r is not None:
            self.stats.observe(self.stats.lease_latency, time.perf_counter() - t0)
            return r
        # DEBUG: under a stalled gateway every node in flight says it, and the count is in the stats.
        log.debug("lease: %s failed for %s; its control plane's own endpoint for %g s", self.lease_url,
                  node.node_id, LEASE_FALLBACK_S)  # fmt: skip
        node.lease_fallback_until = self.clock() + LEASE_FALLBACK_S
        self.stats.lease_fallbacks += 1
        return await self._lease_to_control_plane(body, token)

    async def _to_gateway(self, node: VirtualNode, body: bytes) -> Answer | None:
        """A node's lease on one of the fleet's connections to the gateway; None when it failed, or when
        the node's own keepalive to the gateway failed while this lease waited for a connection."""
        if self._lease_connections is None:
            self._lease_connections = Lanes()
            for _ in range(self.connections):
                # Watched like the control plane's (see run): the watchdog fails a lease unanswered past
                # the agent's lease timeout, and the lease goes to the control plane at once, as an agent's does.
                conn = Connection(self.lease_url, timeout_s=min(self.timeout_s, LEASE_TIMEOUT_S), watched=True)
                self._all_connections.append(conn)
                self._lease_connections.put_nowait(conn)
        conn = await self._take(self._lease_connections)
        if self.clock() < node.lease_fallback_until:
            self._lease_connections.put_nowait(conn)
            return None
        try:
            r = await conn.post(urlsplit(self.lease_url).path, body, node.credential)
        except TransportError as e:
            log.debug("lease: %s: %s", self.lease_url, e)
            return None
        finally:
            self._lease_connections.put_nowait(conn)
        return r if r.status_code not in (404, 405) and r.status_code < 500 else None

    async def _status(self, node: VirtualNode, body: Callable[[], bytes], *, routine: bool = False) -> Answer:
        """A status, and leases to the gateway while it waits, as an agent's (llmgw_agent/keepalive.py).

        The first lease goes KEEPALIVE_AFTER_S after the status was due, its wait for one of the
        fleet's connections included (an agent has its own), then one every interval; none once the
        status is answered. A lease being sent is never cut off: its connection would carry its answer
        to the next request. A routine status says so (llmgw_agent/status.py ROUTINE).
        """
        extra = _ROUTINE_HEAD if routine and self.priority else b""
        # The first status after registering too: the registration's answer named the gateway.
        if not (self.keepalive and self.lease_url):
            return await self._post(HEARTBEAT_PATH, body, node.credential, extra=extra, routine=routine)
        waiting = [True]

        def begin() -> None:
            task = asyncio.ensure_future(self._keepalive(node, waiting))
            self._keepalives.add(task)  # held until it ends: the loop keeps only a weak reference
            task.add_done_callback(self._keepalives.discard)

        timer = asyncio.get_running_loop().call_later(KEEPALIVE_AFTER_S, begin)
        try:
            return await self._post(HEARTBEAT_PATH, body, node.credential, extra=extra, routine=routine)
        finally:
            waiting[0] = False
            timer.cancel()

    async def _keepalive(self, node: VirtualNode, waiting: list[bool]) -> None:
        while waiting[0]:
            if self.clock() >= node.lease_fallback_until:
                t0 = time.perf_counter()
                r = await self._to_gateway(node, node.keepalive(self.clock()))
                if r is not None:
                    self.stats.observe(self.stats.lease_latency, time.perf_counter() - t0)
                    self.stats.keepalives += 1
            await asyncio.sleep(node.interval)

    async def _lease_to_control_plane(self, body: bytes, token: str) -> Answer:
        # A lease a named gateway did not take: counted, to tell its cost on the web server apart.
        self.stats.leases_to_control_plane += 1
        return await self._post(wire.LEASE_PATH, body, token)

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
        self.lease_url = answer.get("lease_url") or ""
        node.interval = max(self.interval, min(600.0, float(answer.get("heartbeat_interval_s") or 0)))
        node.registered = True
        node.leases, node.status, node.digest = False, None, None
        node.last_fabrics = self.clock()
        self.stats.registered += 1
        now = self.clock()
        for cmd in answer.get("commands") or []:
            node.apply(cmd, now)
        return True

    async def _heartbeat(self, node: VirtualNode) -> bool:
        now = self.clock()
        leased = node.lease(now)
        # The status as sent: when it was built, what it reported (its key) and the acks it carried.
        built: list[tuple[float, Any, list[str]]] = []

        def build() -> bytes:
            # Built once a connection is free, as an agent builds its status just before it sends it on a
            # connection of its own: dated before the simulator's own wait, a status read at the control
            # plane as sent by a node whose clock was behind, and a skew finding that came and went with
            # each such wait had the doctor and placement load the node again.
            at = self.clock()
            body, acks = node.heartbeat(at)
            built.append((at, node.status_key(at), acks))
            return body

        t0 = time.perf_counter()
        # A routine status (the floor's alone) may wait for the others (llmgw/front.py).
        why = "" if leased else node.status_due(now)
        routine = why == "floor"
        if leased:
            r = await self._post_lease(node, leased[0])
        else:
            r = await self._status(node, build, routine=routine)
        if r.status_code in (401, 403, 404):
            node.registered = False
            self.stats.heartbeat_errors[str(r.status_code)] += 1
            return False
        if r.status_code != 200:
            self.stats.heartbeat_errors[str(r.status_code)] += 1
            return r.status_code < 500
        self.stats.observe(self.stats.latency, time.perf_counter() - t0)
        if why == "changed":
            self.stats.observe(self.stats.changed_latency, time.perf_counter() - t0)
        self.stats.heartbeats += 1
        if node.faults.lose_answers:
            self.stats.answers_dropped += 1
            return True
        sent_at, key, acks = (now, None, leased[1]) if leased else built[0]
        for a in acks:
            node.acks.pop(a, None)
        answer = r.json()
        if leased:
            self.stats.leases += 1
            if answer.get("send_status"):
                node.status = None
            if leased[2] and not answer.get("status_confirmed"):
                self.stats.floor_digests_unconfirmed += 1
                if not answer.get("send_status"):
                    # Not checked (an older lease endpoint): the floor goes whole, as an agent's would.
                    node.digest = None
            elif leased[2] and node.status is not None:
                # The floor confirmed: the next is a floor's interval from now.
                node.status = (now, node.status[1])
            # As an agent's StatusGate: more commands wait, or the status is wanted: come back at once.
            again = bool(answer.get("again") or answer.get("send_status"))
            node.again_run = node.again_run + 1 if again else 0
        else:
            node.again_run = 0
            if node.status is None and not node.leases:
                self.stats.first_statuses += 1  # its first since registering: the node has joined
            node.leases, node.status = bool(answer.get("leases")), (sent_at, key)
            node.digest = answer.get("status_digest") if self.floor_digests else None
            self.lease_url = answer.get("lease_url") or ""
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
                delay = self._next_beat(node, delay)
            else:
                failures += 1
                delay = backoff_delay(failures, rng)
            due = time.monotonic() + delay
            await asyncio.sleep(delay)
            self.stats.observe(self.stats.lateness, max(0.0, time.monotonic() - due))

    def _next_beat(self, node: VirtualNode, delay: float) -> float:
        """The wait before a node's next heartbeat, as an agent's loop decides it (llmgw_agent/loop.py).

        At once after an answer that said come back (up to MAX_AGAIN in a row);
        else the interval, cut short when one of its shards becomes ready: the
        agent's wait polls its supervisor every second and reports a ready
        shard at the poll that sees it, within a second, not an interval later
        (a start's loading waits for the next heartbeat).
        """
        if 0 < node.again_run <= MAX_AGAIN:
            return 0.0
        now = self.clock()
        change = node.next_change(now)
        if change is None or change - now >= delay:
            return delay
        return min(delay, float(math.ceil(change - now)))

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
            now = time.monotonic()
            for c in self._all_connections:
                c.expire(now)
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
        # Watched: _watch fails a request past the timeout, so none needs a timer of its own.
        url, timeout = self.control_plane, self.timeout_s
        conns = [Connection(url, timeout_s=timeout, watched=True) for _ in range(self.connections)]
        self.use_connections(conns)
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
            while self._lease_connections is not None and not self._lease_connections.empty():
                self._lease_connections.get_nowait().close()
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

        self._thread = threading.Thread(target=run_loop, args=(go(),), name="fleet", daemon=True)
        self._thread.start()
        started.wait(30)

    def join(self, timeout: float = 30.0) -> None:
        """Stop the fleet and wait for its thread to end."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llmgw_sim.fleet", description=__doc__.split("\n\n")[0])
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
    ap.add_argument(
        "--no-keepalive", action="store_true", help="no lease while a status waits (as agents before keepalive.py)"
    )
    ap.add_argument(
        "--no-priority", action="store_true", help="routine statuses not marked so (as agents before ROUTINE)"
    )
    ap.add_argument(
        "--no-floor-digests", action="store_true", help="status floors sent whole (as agents before status digests)"
    )
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
        keepalive=not args.no_keepalive,
        priority=not args.no_priority,
        floor_digests=not args.no_floor_digests,
    )

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, fleet.stop)
        await fleet.run(
            control=Path(args.control) if args.control else None, stats=Path(args.stats) if args.stats else None
        )

    run_loop(go())
    return 0


if __name__ == "__main__":
    sys.exit(main())
