"""The agent loop: register, heartbeat, apply commands, and never give up on the control plane.

The agent joins with the join token the first time and keeps the credential it
is given (state_dir/credential, mode 0600); after that it registers with its
own credential, and falls back to the join token when that is refused (an
operator reset it). When a heartbeat's answer asks for a new credential
(an operator's "Rotate"), the agent trades its credential for a new one at the
rotate endpoint and stores it atomically; the old one keeps working until the
new one is first used, so a lost answer never locks the agent out. Every
heartbeat carries sensors, shard states and the ids of the commands it has
applied; commands are applied at most once by id, since the control plane
repeats a command until the agent's ack reaches it. While the control plane
is unreachable the agent backs off with jitter (so a restarted control plane
is not met by every node at the same instant) and keeps supervising its
shards; no transient error ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pydantic

import llmgw_wire as wire
from llmgw_agent.client import ControlPlane, NeedsRegister, Refused, Unreachable, route_addr
from llmgw_agent.commands import Commands
from llmgw_agent.config import Config
from llmgw_agent.keepalive import Keepalive
from llmgw_agent.metrics import Latest, MetricsServer, metrics_addr
from llmgw_agent.netif import interface_addr
from llmgw_agent.ports import listening_ports
from llmgw_agent.probe import DiscoveryProbe, Probe
from llmgw_agent.shardload import ShardMeter
from llmgw_agent.state import AppliedJournal, CredentialFile
from llmgw_agent.status import StatusGate
from llmgw_agent.supervisor import Supervisor
from llmgw_agent.wakeup import Listener, shard_states, worth_reporting_now
from llmgw_wire.priority import ROUTINE

# Part of this module's interface: the CLI and the tests take them from here.
__all__ = ["Agent", "DiscoveryProbe", "NeedsRegister", "Probe", "Refused", "Unreachable", "backoff_delay"]

log = logging.getLogger("llmgw.agent")

AGENT_VERSION = "0.1.0"
FEATURES = ["adoption", "echo-engine", "gpu-fabrics", "fabric-scan"]
FABRIC_EVERY_S = 60.0
BACKOFF_BASE_S = 1.0
# Small on purpose: the control plane does not judge a node on its own outage
# (inventory/liveness.py), but it can only hear a node that is back; an agent
# backed off for a minute returns long after the control plane did, and its
# silence after the outage counts. Jitter spreads the fleet's return.
BACKOFF_CAP_S = 5.0
# A registration carries the whole inventory and may wait on a loaded control
# plane; giving up early only sends it again (registration is idempotent).
REGISTER_TIMEOUT_S = 60.0
# After the gateway's lease endpoint failed, leases go to the control plane's own this long
# before the gateway is tried again: a gateway that is down costs one failed try a minute.
LEASE_FALLBACK_S = 60.0
# A lease to the gateway is answered within milliseconds (a batch window and one statement), so one
# unanswered for this long is not a slow gateway but a stalled one: the lease goes to the control plane
# at once. Waiting the client's whole timeout instead left every lease of the fleet waiting on a
# gateway whose event loop was busy, and a fleet that renews through one process fell silent together.
LEASE_TIMEOUT_S = 2.0

_Answer = TypeVar("_Answer", bound=pydantic.BaseModel)


def backoff_delay(attempt: int, rng: random.Random) -> float:
    """Exponential backoff with jitter: between half and all of min(cap, base * 2^(attempt-1))."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1))
    return ceiling * (0.5 + rng.random() / 2)


class Agent:
    """One node's agent: registration, heartbeats, commands."""

    def __init__(
        self,
        config: Config,
        *,
        probe: Probe,
        supervisor: Supervisor | None = None,
        http: httpx.Client | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        listening: Callable[[], list[int]] = listening_ports,
    ) -> None:
        self.config = config
        # What listens on this node, read for every heartbeat (llmgw_agent/ports.py).
        self.listening = listening
        self.probe = probe
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.state_dir, 0o700)
        self.supervisor = supervisor or Supervisor(self.state_dir, mgmt_interface=config.mgmt_interface)
        self.http = http or httpx.Client(base_url=config.control_plane, timeout=httpx.Timeout(15.0, connect=5.0))
        self.control_plane = ControlPlane(self.http, config.control_plane)
        self.credential_file = CredentialFile(self.state_dir)
        self.journal = AppliedJournal(self.state_dir / "applied.json")
        self.rng = rng or random.Random()
        self.clock = clock
        self.commands = Commands(
            node_id=config.node_id,
            supervisor=self.supervisor,
            probe=probe,
            control_plane=self.control_plane,
            credential=self.credential_file,
            journal=self.journal,
            clock=clock,
        )
        self.interval = config.heartbeat_interval
        self.registered = False
        self._last_fabrics = 0.0
        self._previous_sample: Any = None
        self._shard_meter = ShardMeter()
        self._problems: set[str] = set()
        self._declared_hcas: frozenset[str] = frozenset()
        self._seen_hcas: frozenset[str] = frozenset()
        # Status when it changed, a lease otherwise (llmgw_agent/status.py).
        self.status = StatusGate()
        # Leases to the gateway while a status waits in the web tier's queue (llmgw_agent/keepalive.py).
        self.keepalive = Keepalive(self._keepalive_lease, every=lambda: self.interval)
        self.stop_event = threading.Event()
        # Set by the wakeup long-poll (llmgw_agent/wakeup.py): work is waiting, heartbeat now.
        self.woken = threading.Event()
        self.listener: Listener | None = None
        # The gateway the control plane's answers name for the long-poll ("" until one does).
        self.advertised_wakeup = ""
        # Where the control plane takes leases in batches (its gateway, llmgw_wire/lease.py); "" for its own endpoint.
        self.advertised_lease = ""
        # Until when (clock) leases go to the control plane's own endpoint, after the gateway's failed.
        self.lease_fallback_until = 0.0
        self.metrics = Latest(clock)
        self.metrics_server = (
            MetricsServer(
                self.metrics, listen=config.metrics_listen, token=config.metrics_token, open_=config.metrics_open
            ).start()
            if config.metrics_listen
            else None
        )

    @property
    def installs(self) -> dict[str, wire.EngineInstall]:
        """What this node reports of its engine installs (the answers to InstallEngine)."""
        return self.commands.installs

    def credential(self) -> str:
        """This node's own credential, '' before the first registration."""
        return self.credential_file.read()

    def wakeup_gateway(self) -> str:
        """Where the long-poll is held: agent.yaml's wakeup_url, else the control plane's; "" when neither names one."""
        return self.config.wakeup_url or self.advertised_wakeup

    def _answer(
        self, r: httpx.Response, model: type[_Answer], what: str, *, reregister_on: tuple[int, ...] = ()
    ) -> _Answer:
        # The client's reading of the answer; a NeedsRegister also means this agent is no longer registered.
        try:
            return self.control_plane.answer(r, model, what, reregister_on=reregister_on)
        except NeedsRegister:
            self.registered = False
            raise

    def rotate_credential(self) -> bool:
        """Trade the current credential for a new one (an operator asked); True when stored.

        The control plane keeps the old credential valid until the new one is
        first used, so any failure here (no answer, a refusal, a full disk)
        leaves the agent with a working credential, and the request stays
        outstanding until a rotation succeeds. Neither secret is ever logged.
        """
        r = self.control_plane.post(
            "/api/v1/agent/rotate", wire.RotateCredential(node_id=self.config.node_id), self.credential()
        )
        resp = self._answer(r, wire.RegisterResponse, "credential rotation", reregister_on=(401, 403))
        if not resp.credential:
            raise Refused("the rotation answer carries no credential")
        self.credential_file.save(resp.credential)
        log.info("credential rotated; the new one is stored in %s (mode 0600)", self.credential_file.path)
        return True

    def registration(self) -> wire.Register:
        """The registration: the whole inventory, the fabrics from agent.yaml and the shards running."""
        d = self.probe.discover()
        for problem in getattr(d, "problems", []) or []:
            log.warning("discovery: %s", problem)
        self.commands.engine_versions = dict(getattr(d, "engine_versions", {}) or {})
        self.supervisor.engine_versions = dict(self.commands.engine_versions)
        c = self.config
        # What the supervisor checks every StartShard against: this node's own cards and adapters.
        self.supervisor.gpus = frozenset(g.index for g in getattr(d, "gpus", []) or [])
        self._declared_hcas = frozenset(h for f in c.fabrics for h in f.hcas)
        self.supervisor.hcas = self._declared_hcas | self._seen_hcas
        mgmt_addr = (interface_addr(c.mgmt_interface) if c.mgmt_interface else "") or route_addr(c.control_plane)
        return wire.Register(
            node_id=c.node_id,
            hostname=c.node_id if c.root else socket.gethostname(),
            mgmt_addr=mgmt_addr,
            labels=c.labels,
            agent_version=AGENT_VERSION,
            features=FEATURES,
            engine_versions=self.commands.engine_versions,
            engines_probed=bool(getattr(d, "engines_probed", False)),
            memory_total_mb=getattr(d, "memory_total_mb", None),
            cpu_count=getattr(d, "cpu_count", None),
            host=getattr(d, "host", None),
            gpus=list(getattr(d, "gpus", []) or []),
            storage=getattr(d, "storage", None),
            weights=getattr(d, "weights", None),
            fabrics=[wire.FabricAttachment(name=f.name, hcas=list(f.hcas), rate_gbps=f.rate_gbps) for f in c.fabrics],
            imex=getattr(d, "imex", None),
            running_shards=self.supervisor.running(),
            engine_installs=list(self.installs.values()) or None,
            at=self.clock(),
            metrics_addr=metrics_addr(self.metrics_server, c.metrics_listen, mgmt_addr),
        )

    def register(self) -> wire.RegisterResponse:
        """Register with the node's credential, or the join token the first time (or after a reset)."""
        body = self.registration()
        own = self.credential()
        if own:
            r = self.control_plane.post("/api/v1/agent/register", body, own, timeout=REGISTER_TIMEOUT_S)
            if r.status_code in (401, 403):
                log.warning("the control plane refused this node's credential (reset?); joining again with the token")
                own = ""
        if not own:
            c = self.config
            source = c.source or "agent.yaml"
            token = c.token()
            if not token:
                raise Refused(
                    f"this node has no credential yet and {source} gives no join token:"
                    " set join_token or join_token_file (an operator creates one)"
                )
            body = body.model_copy(update={"join_nonce": self.credential_file.join_nonce()})
            r = self.control_plane.post("/api/v1/agent/register", body, token, timeout=REGISTER_TIMEOUT_S)
            if r.status_code == 401:
                key = f"join_token_file {c.join_token_file!r}" if c.join_token_file else "join_token"
                raise Refused(
                    f"the join token was refused (401): {key} in {source} holds a token that is unknown,"
                    " revoked, expired or used up; ask an operator for a new one"
                )
            if r.status_code == 403:
                # A valid token, but this node id already holds a credential (its state
                # directory was lost). The control plane's words name no node, so that a
                # token's holder cannot probe which ids exist: the agent, which knows its
                # own id, says what is meant.
                raise Refused(
                    f"the join token was refused (403): node id {c.node_id!r} already holds a credential"
                    f" (was {self.credential_file.path} lost?); an operator must reset it before a join token"
                    f" can take it ({self.control_plane.why(r)})"
                )
        resp = self._answer(r, wire.RegisterResponse, "registration")
        if resp.credential:
            self.credential_file.save(resp.credential)
            self.credential_file.forget_join_nonce()
            log.info("registered as %s; credential stored in %s (mode 0600)", resp.node_id, self.credential_file.path)
        else:
            log.info("registered as %s", resp.node_id)
        if resp.adopted:
            log.info("the control plane adopted shards %s", ", ".join(resp.adopted))
        self.interval = max(self.config.heartbeat_interval, min(600.0, resp.heartbeat_interval_s or 0))
        self.advertised_wakeup = resp.wakeup_url or ""
        self.advertised_lease = resp.lease_url or ""
        self.registered = True
        self.status.reset()
        self._last_fabrics = self.clock()  # the registration carried them
        self.commands.apply_all(resp.commands)
        return resp

    def _shard_loads(self) -> dict[str, wire.ShardLoad]:
        return self._shard_meter.measure(self.supervisor.pids())

    def heartbeat_body(self) -> wire.Heartbeat:
        """What this heartbeat says: sensors, shard states, engine installs, acks."""
        self.supervisor.poll()
        sample = self.probe.sample(self._previous_sample)
        self._previous_sample = sample
        problems = set(getattr(sample, "problems", []) or [])
        for p in sorted(problems - self._problems):
            log.warning("sensors: %s", p)
        self._problems = problems
        seen = frozenset(p.hca for p in getattr(sample, "ib_ports", None) or [])
        if seen - self._seen_hcas:
            self._seen_hcas |= seen
            self.supervisor.hcas = self._declared_hcas | self._seen_hcas
        load = getattr(sample, "load", None)
        if load is not None:
            load = load.model_copy(update={"shards": self._shard_loads()})
        fabrics = None
        if self.clock() - self._last_fabrics >= FABRIC_EVERY_S:
            fabrics = self.probe.gpu_fabrics()
            self._last_fabrics = self.clock()
        acks = self.commands.acks()
        body = wire.Heartbeat(
            node_id=self.config.node_id,
            at=self.clock(),
            load=load,
            gpus=getattr(sample, "gpus", None),
            ib_ports=getattr(sample, "ib_ports", None),
            shards=self.supervisor.statuses(),
            engine_installs=list(self.installs.values()) or None,
            gpu_fabrics=fabrics,
            imex=getattr(sample, "imex", None),
            listening_ports=self.listening(),
            acks=acks,
        )
        self.metrics.update(body)
        return body

    def heartbeat(self) -> wire.HeartbeatResponse | wire.LeaseResponse:
        """Send one heartbeat (the status, or a lease when nothing changed) and apply the commands in its answer."""
        body = self.heartbeat_body()
        lease = self.status.lease(body, now=self.clock())
        sent, path, model = (
            (body, "/api/v1/agent/heartbeat", wire.HeartbeatResponse)
            if lease is None
            else (lease, wire.LEASE_PATH, wire.LeaseResponse)
        )
        r = self._post_lease(lease) if lease is not None else None
        if r is None:
            # While a status waits in the web tier's queue, leases keep the node alive (llmgw_agent/keepalive.py).
            waits = self.keepalive.during() if lease is None and self.advertised_lease else contextlib.nullcontext()
            with waits:
                routine = ROUTINE if lease is None and self.status.routine() else None
                r = self.control_plane.post(path, sent, self.credential(), headers=routine)
        resp = self._answer(r, model, "heartbeat", reregister_on=(401, 403, 404))
        self.status.answered(sent, resp, now=self.clock())
        if isinstance(resp, wire.HeartbeatResponse):
            self.advertised_wakeup = resp.wakeup_url or ""
            self.advertised_lease = resp.lease_url or ""
        self.commands.acknowledged(body.acks)
        before = shard_states(self.supervisor)
        self.commands.apply_all(resp.commands)
        if any(
            state == wire.ShardState.FAILED and (sid, state) not in before
            for sid, state in shard_states(self.supervisor)
        ):
            # A start refused at once (its port taken, its GPUs held): the control plane hears it now and
            # places the replica again, not an interval later.
            self.woken.set()
        if resp.rotate_credential:
            try:
                self.rotate_credential()
            except (Unreachable, Refused, OSError) as e:
                # The old credential still works; the next heartbeat asks again.
                log.warning("credential rotation failed, keeping the current credential: %s", e)
        return resp

    def _post_lease(self, lease: wire.Lease) -> httpx.Response | None:
        """The lease sent to the gateway the control plane named (lease_url); None: send it to the control plane.

        A gateway that does not answer within LEASE_TIMEOUT_S, answers with a server error, or has no
        such endpoint (404, 405: an older gateway) is passed over for
        LEASE_FALLBACK_S, and this lease goes to the control plane's own
        endpoint at once: a lease is never lost to the faster path.
        """
        url = self.advertised_lease
        if not url or self.clock() < self.lease_fallback_until:
            return None
        try:
            r = self.control_plane.post(url, lease, self.credential(), timeout=LEASE_TIMEOUT_S)
        except Unreachable as e:
            why = str(e)
        else:
            if r.status_code not in (404, 405):
                return r
            why = f"HTTP {r.status_code}"
        log.warning("lease: %s failed (%s); the control plane's own endpoint for %g s", url, why, LEASE_FALLBACK_S)
        self.lease_fallback_until = self.clock() + LEASE_FALLBACK_S
        return None

    def _keepalive_lease(self) -> None:
        """A lease to the gateway while a status waits (llmgw_agent/keepalive.py); its answer is the status's to give.

        No acks (they ride in the status) and no fallback to the control plane's own endpoint: that is
        the queue the status waits in. A gateway that fails is left to the loop's next lease to find.
        """
        url = self.advertised_lease
        if not url or self.clock() < self.lease_fallback_until:
            return
        lease = wire.Lease(node_id=self.config.node_id, at=self.clock())
        try:
            r = self.control_plane.post(url, lease, self.credential(), timeout=LEASE_TIMEOUT_S)
        except Unreachable as e:
            log.info("lease while a status waits: %s failed (%s)", url, e)
            return
        if r.status_code != 200:
            log.info("lease while a status waits: %s answered HTTP %d", url, r.status_code)

    def step(self) -> None:
        """Register if needed, then one heartbeat. Raises on failure (the caller backs off)."""
        if not self.registered:
            self.register()
        self.heartbeat()

    def _wait(self, seconds: float) -> None:
        """Wait, keeping the shards supervised (startup timeouts, SIGKILL after grace)."""
        end = time.monotonic() + seconds
        while not self.stop_event.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            if self.woken.wait(min(1.0, left)):
                self.woken.clear()
                return
            before = shard_states(self.supervisor)
            try:
                self.supervisor.poll()
            except Exception:
                log.exception("supervising shards")
            if worth_reporting_now(before, shard_states(self.supervisor)):
                return  # a shard is ready or ended: the control plane hears it now, not next interval

    def run(self, *, max_steps: int | None = None) -> None:
        """Heartbeat until stopped; every error is logged and retried with backoff, none ends the agent."""
        failures = 0
        steps = 0
        log.info(
            "llmgw-agent %s: node %s, control plane %s", AGENT_VERSION, self.config.node_id, self.config.control_plane
        )
        if self.listener is None and max_steps is None and not self.config.wakeup:
            log.info(
                "wakeup long-poll off (agent.yaml: wakeup: false): commands arrive with heartbeats, every %g s",
                self.interval,
            )
        elif self.listener is None and max_steps is None:
            self.listener = Listener(
                self.config.control_plane,
                self.config.node_id,
                # Only once registered: the registration's answer names the gateway to poll.
                lambda: self.credential() if self.registered else "",
                gateway=self.wakeup_gateway,
                woken=self.woken,
                stop=self.stop_event,
            ).start()
        while not self.stop_event.is_set() and (max_steps is None or steps < max_steps):
            steps += 1
            try:
                self.step()
            except NeedsRegister as e:
                log.warning("%s; registering again", e)
                failures += 1
                if failures > 1:
                    self._wait(backoff_delay(failures, self.rng))
                continue
            except (Unreachable, Refused) as e:
                failures += 1
                delay = backoff_delay(failures, self.rng)
                log.warning("control plane: %s; retrying in %.1fs", e, delay)
                self._wait(delay)
                continue
            except Exception:
                failures += 1
                delay = backoff_delay(failures, self.rng)
                log.exception("unexpected error; retrying in %.1fs", delay)
                self._wait(delay)
                continue
            if failures:
                log.info("control plane reachable again")
            failures = 0
            self._wait(self.status.wait_s(self.interval))

    def close(self) -> None:
        """Stop the loop; shards keep running (the next agent adopts them)."""
        self.stop_event.set()
        self.keepalive.close()
        if self.listener is not None:
            self.listener.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.supervisor.close()
        with contextlib.suppress(Exception):
            self.http.close()
