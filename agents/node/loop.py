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
import json
import logging
import os
import random
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

import httpx
import pydantic

import wire
from agents.node.config import Config
from agents.node.metrics import Latest, MetricsServer, metrics_addr
from agents.node.netif import interface_addr
from agents.node.shardload import ShardMeter
from agents.node.status import StatusGate
from agents.node.supervisor import Supervisor

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
APPLIED_KEEP = 2000
# Shards started per answer of the control plane; the rest wait (unacknowledged, so
# repeated) for the next heartbeat. A control plane gone wrong then starts a
# handful of engines a heartbeat, not hundreds in seconds.
MAX_STARTS_PER_ANSWER = 8

_Answer = TypeVar("_Answer", bound=pydantic.BaseModel)


class Probe(Protocol):
    """What the loop needs from hardware discovery (agents.node.discovery, or a test's own)."""

    def discover(self) -> Any: ...
    def sample(self, previous: Any = None) -> Any: ...
    def gpu_fabrics(self) -> list[wire.GPUFabricReport]: ...
    def ibnetdiscover(self, *, hca: str, port: int, timeout: float) -> Any: ...


class DiscoveryProbe:
    """The real probe: agents.node.discovery, on the live machine or a fixture root."""

    def __init__(self, *, root: str | Path | None, model_dirs: list[str]) -> None:
        from agents.node import discovery  # imported here so the loop runs (and is tested) without it

        self._d = discovery
        self.root = Path(root) if root else None
        self.model_dirs = list(model_dirs)

    def discover(self) -> Any:
        return self._d.discover(root=self.root, model_dirs=self.model_dirs)

    def sample(self, previous: Any = None) -> Any:
        return self._d.sample(root=self.root, previous=previous)

    def gpu_fabrics(self) -> list[wire.GPUFabricReport]:
        return self._d.gpu_fabrics(root=self.root)

    def ibnetdiscover(self, *, hca: str, port: int, timeout: float) -> Any:
        return self._d.ibnetdiscover(hca=hca, port=port, timeout=timeout, root=self.root)


class Unreachable(Exception):
    """The control plane did not answer, or answered with a server error: try again later."""


class Refused(Exception):
    """The control plane refused the request (a 4xx other than an auth failure)."""


class NeedsRegister(Exception):
    """The control plane no longer knows this agent's credential or node: register again."""


def route_addr(url: str) -> str:
    """The local address this host uses to reach a URL (no packet is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return ""


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
    ) -> None:
        self.config = config
        self.probe = probe
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.state_dir, 0o700)
        self.supervisor = supervisor or Supervisor(self.state_dir, mgmt_interface=config.mgmt_interface)
        self.http = http or httpx.Client(base_url=config.control_plane, timeout=httpx.Timeout(15.0, connect=5.0))
        self.rng = rng or random.Random()
        self.clock = clock
        self.interval = config.heartbeat_interval
        self.registered = False
        self.installs: dict[str, wire.EngineInstall] = {}
        self.engine_versions: dict[str, str] = {}
        self._acks: dict[str, None] = {}
        self._applied: dict[str, float] = self._load_applied()
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._last_fabrics = 0.0
        self._previous_sample: Any = None
        self._shard_meter = ShardMeter()
        self._problems: set[str] = set()
        self._declared_hcas: frozenset[str] = frozenset()
        self._seen_hcas: frozenset[str] = frozenset()
        # Status when it changed, a lease otherwise (agents/node/status.py).
        self.status = StatusGate()
        self.stop_event = threading.Event()
        self.metrics = Latest(clock)
        self.metrics_server = (
            MetricsServer(
                self.metrics, listen=config.metrics_listen, token=config.metrics_token, open_=config.metrics_open
            ).start()
            if config.metrics_listen
            else None
        )

    # --- credential -------------------------------------------------------

    @property
    def credential_path(self) -> Path:
        return self.state_dir / "credential"

    def credential(self) -> str:
        """This node's own credential, '' before the first registration."""
        try:
            return self.credential_path.read_text().strip()
        except OSError:
            return ""

    def _save_credential(self, value: str) -> None:
        """Store the credential atomically: a crash leaves the old file or the new, never half of one.

        The temporary file is created 0600 in the same directory (so the
        rename stays on one filesystem) and synced before it replaces the old
        one; the directory is synced after, so the rename itself survives a
        power loss.
        """
        fd, tmp = tempfile.mkstemp(prefix=".credential-", suffix=".tmp", dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.credential_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @property
    def _join_nonce_path(self) -> Path:
        return self.state_dir / "join-nonce"

    def _join_nonce(self) -> str:
        """The secret that makes a retried join recognisable as this agent's, drawn once and kept until joined.

        Written before the first try, so a join whose answer was lost (the
        agent timed out, the server went on and issued the credential) is
        retried with the same nonce, and gets the credential again.
        """
        path = self._join_nonce_path
        with contextlib.suppress(OSError):
            value = path.read_text().strip()
            if len(value) >= 32:
                return value
        value = secrets.token_urlsafe(32)
        fd, tmp = tempfile.mkstemp(prefix=".join-nonce-", suffix=".tmp", dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return value

    def rotate_credential(self) -> bool:
        """Trade the current credential for a new one (an operator asked); True when stored.

        The control plane keeps the old credential valid until the new one is
        first used, so any failure here (no answer, a refusal, a full disk)
        leaves the agent with a working credential, and the request stays
        outstanding until a rotation succeeds. Neither secret is ever logged.
        """
        r = self._post("/api/v1/agent/rotate", wire.RotateCredential(node_id=self.config.node_id), self.credential())
        resp = self._answer(r, wire.RegisterResponse, "credential rotation", reregister_on=(401, 403))
        if not resp.credential:
            raise Refused("the rotation answer carries no credential")
        self._save_credential(resp.credential)
        log.info("credential rotated; the new one is stored in %s (mode 0600)", self.credential_path)
        return True

    # --- applied commands -------------------------------------------------

    def _applied_path(self) -> Path:
        return self.state_dir / "applied.json"

    def _load_applied(self) -> dict[str, float]:
        try:
            data = json.loads(self._applied_path().read_text())
            return {str(k): float(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _mark_applied(self, cmd_id: str) -> None:
        with self._lock:
            self._applied[cmd_id] = self.clock()
            if len(self._applied) > APPLIED_KEEP:
                for k in sorted(self._applied, key=self._applied.__getitem__)[: len(self._applied) - APPLIED_KEEP]:
                    del self._applied[k]
            self._acks[cmd_id] = None
            tmp = self._applied_path().with_suffix(".tmp")
            tmp.write_text(json.dumps(self._applied))
            os.replace(tmp, self._applied_path())

    # --- HTTP -------------------------------------------------------------

    def _post(self, path: str, body: pydantic.BaseModel, token: str, *, timeout: float | None = None) -> httpx.Response:
        extra = {"timeout": httpx.Timeout(timeout, connect=5.0)} if timeout else {}
        try:
            r = self.http.post(
                path,
                content=body.model_dump_json(exclude_none=True),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                **extra,
            )
        except httpx.TransportError as e:
            raise Unreachable(f"{self.config.control_plane}{path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 500:
            raise Unreachable(f"{path}: HTTP {r.status_code}")
        return r

    @staticmethod
    def _why(r: httpx.Response) -> str:
        """The control plane's own words for a refusal (its `detail`), else the start of the body."""
        try:
            detail = r.json().get("detail")
        except (ValueError, AttributeError):
            detail = None
        return f"HTTP {r.status_code}: {detail if isinstance(detail, str) else r.text[:500]}"

    def _answer(
        self, r: httpx.Response, model: type[_Answer], what: str, *, reregister_on: tuple[int, ...] = ()
    ) -> _Answer:
        """The control plane's answer to `what`, read as `model`.

        A status in `reregister_on` means the control plane no longer knows
        this node or its credential (NeedsRegister); any other status but 200
        is a refusal; an answer that does not parse is treated like no answer.
        """
        if r.status_code in reregister_on:
            self.registered = False
            raise NeedsRegister(f"{what} refused ({r.status_code})")
        if r.status_code != 200:
            raise Refused(f"{what} refused: {self._why(r)}")
        try:
            return model.model_validate_json(r.content)
        except pydantic.ValidationError as e:
            raise Unreachable(f"unreadable {what} answer: {e}") from e

    # --- registration -----------------------------------------------------

    def registration(self) -> wire.Register:
        """The registration: the whole inventory, the fabrics from agent.yaml and the shards running."""
        d = self.probe.discover()
        for problem in getattr(d, "problems", []) or []:
            log.warning("discovery: %s", problem)
        self.engine_versions = dict(getattr(d, "engine_versions", {}) or {})
        self.supervisor.engine_versions = dict(self.engine_versions)
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
            engine_versions=self.engine_versions,
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
            r = self._post("/api/v1/agent/register", body, own, timeout=REGISTER_TIMEOUT_S)
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
            body = body.model_copy(update={"join_nonce": self._join_nonce()})
            r = self._post("/api/v1/agent/register", body, token, timeout=REGISTER_TIMEOUT_S)
            if r.status_code == 401:
                key = f"join_token_file {c.join_token_file!r}" if c.join_token_file else "join_token"
                raise Refused(
                    f"the join token was refused (401): {key} in {source} holds a token that is unknown,"
                    " revoked, expired or used up; ask an operator for a new one"
                )
            if r.status_code == 403:
                # A valid token, but this node id already holds a credential
                # (its state directory was lost): the control plane says so.
                raise Refused(f"the join token was refused: {self._why(r)}")
        resp = self._answer(r, wire.RegisterResponse, "registration")
        if resp.credential:
            self._save_credential(resp.credential)
            # Joined: the next join (after an operator's reset) is a new one, with a new nonce.
            self._join_nonce_path.unlink(missing_ok=True)
            log.info("registered as %s; credential stored in %s (mode 0600)", resp.node_id, self.credential_path)
        else:
            log.info("registered as %s", resp.node_id)
        if resp.adopted:
            log.info("the control plane adopted shards %s", ", ".join(resp.adopted))
        self.interval = max(self.config.heartbeat_interval, min(600.0, resp.heartbeat_interval_s or 0))
        self.registered = True
        self.status.reset()
        self._last_fabrics = self.clock()  # the registration carried them
        self.apply_all(resp.commands)
        return resp

    # --- heartbeat --------------------------------------------------------

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
        with self._lock:
            acks = list(self._acks)[: wire.MAX_COMMANDS]
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
        r = self._post(path, sent, self.credential())
        resp = self._answer(r, model, "heartbeat", reregister_on=(401, 403, 404))
        self.status.answered(sent, resp, now=self.clock())
        with self._lock:
            for a in body.acks:
                self._acks.pop(a, None)
        self.apply_all(resp.commands)
        if resp.rotate_credential:
            try:
                self.rotate_credential()
            except (Unreachable, Refused, OSError) as e:
                # The old credential still works; the next heartbeat asks again.
                log.warning("credential rotation failed, keeping the current credential: %s", e)
        return resp

    # --- commands ---------------------------------------------------------

    def apply_all(self, cmds: list[wire.StartShard | wire.StopShard | wire.ScanFabric | wire.InstallEngine]) -> int:
        """Apply an answer's commands in order, starting at most MAX_STARTS_PER_ANSWER new shards; returns how many
        StartShards were put off (left unacknowledged, so the control plane sends them again)."""
        starts = deferred = 0
        for cmd in cmds:
            if isinstance(cmd, wire.StartShard) and self._new_start(cmd):
                if starts >= MAX_STARTS_PER_ANSWER:
                    deferred += 1
                    continue
                starts += 1
            self.apply(cmd)
        if deferred:
            log.warning("%d shard starts put off to the next heartbeat (at most %d a heartbeat)", deferred, starts)
        return deferred

    def _new_start(self, cmd: wire.StartShard) -> bool:
        with self._lock:
            if cmd.id and (cmd.id in self._applied or cmd.id in self._inflight):
                return False
        existing = self.supervisor.shards.get(cmd.shard_id)
        return existing is None or existing.st in (wire.ShardState.STOPPED, wire.ShardState.FAILED)

    def apply(self, cmd: wire.StartShard | wire.StopShard | wire.ScanFabric | wire.InstallEngine) -> None:
        """Apply one command once: a command id seen before is acknowledged again, not re-applied."""
        if cmd.id:
            with self._lock:
                if cmd.id in self._applied:
                    self._acks[cmd.id] = None
                    return
                if cmd.id in self._inflight:
                    return
        log.info("command %s: %s", cmd.id or "(no id)", cmd.kind)
        try:
            if isinstance(cmd, wire.StartShard):
                shard = self.supervisor.start(cmd)
                log.info("command %s: shard %s is %s %s", cmd.id, cmd.shard_id, shard.state, shard.reason)
            elif isinstance(cmd, wire.StopShard):
                if self.supervisor.stop(cmd.shard_id, grace_s=cmd.grace_s, reason=cmd.reason) is None:
                    log.info("command %s: shard %s is not on this node; nothing to stop", cmd.id, cmd.shard_id)
            elif isinstance(cmd, wire.InstallEngine):
                self.installs[cmd.engine] = self.install_state(cmd)
                log.info("command %s: engine %s is %s", cmd.id, cmd.engine, self.installs[cmd.engine].state)
            elif isinstance(cmd, wire.ScanFabric):
                with self._lock:
                    self._inflight.add(cmd.id)
                threading.Thread(target=self._scan, args=(cmd,), name=f"scan-{cmd.key}", daemon=True).start()
                return
        except Exception:
            # Not acknowledged: the control plane repeats it and the next try may succeed.
            log.exception("command %s (%s) could not be applied", cmd.id, cmd.kind)
            return
        if cmd.id:
            self._mark_applied(cmd.id)

    def install_state(self, cmd: wire.InstallEngine) -> wire.EngineInstall:
        """An honest answer to an install request: this agent does not install engines, it reports them."""
        have = self.engine_versions.get(cmd.engine, "")
        if have and (not cmd.version or have == cmd.version):
            return wire.EngineInstall(engine=cmd.engine, version=have, variant=cmd.variant, state="ready")
        detail = f"this agent does not install engines; install {cmd.engine}"
        detail += f" {cmd.version}" if cmd.version else ""
        detail += f" on the node (found: {have or 'none'}) and restart the agent"
        return wire.EngineInstall(
            engine=cmd.engine, version=cmd.version, variant=cmd.variant, state="unsupported", detail=detail
        )

    def _scan(self, cmd: wire.ScanFabric) -> None:
        started = time.monotonic()
        try:
            result = self.probe.ibnetdiscover(hca=cmd.hca, port=cmd.port, timeout=cmd.timeout_s)
            upload = wire.ScanUpload(
                node_id=self.config.node_id,
                command_id=cmd.id,
                key=cmd.key,
                hca=cmd.hca,
                port=cmd.port,
                output=(result.stdout or "") if result.ok else "",
                error="" if result.ok else (result.error or "ibnetdiscover failed")[:4000],
                took_s=round(time.monotonic() - started, 3),
            )
            r = self._post("/api/v1/agent/scans", upload, self.credential())
            if r.status_code not in (200, 201, 202):
                raise Refused(f"scan upload refused: {self._why(r)}")
            log.info(
                "command %s: scan of %s port %d uploaded (%s)",
                cmd.id,
                cmd.hca,
                cmd.port,
                "ok" if result.ok else "failed",
            )
            if cmd.id:
                self._mark_applied(cmd.id)
        except Exception as e:
            log.warning("command %s: scan of %s port %d not uploaded: %s", cmd.id, cmd.hca, cmd.port, e)
        finally:
            with self._lock:
                self._inflight.discard(cmd.id)

    # --- running ----------------------------------------------------------

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
            self.stop_event.wait(min(1.0, left))
            try:
                self.supervisor.poll()
            except Exception:
                log.exception("supervising shards")

    def run(self, *, max_steps: int | None = None) -> None:
        """Heartbeat until stopped; every error is logged and retried with backoff, none ends the agent."""
        failures = 0
        steps = 0
        log.info(
            "llmgw-agent %s: node %s, control plane %s", AGENT_VERSION, self.config.node_id, self.config.control_plane
        )
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
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.supervisor.close()
        with contextlib.suppress(Exception):
            self.http.close()
