"""The control plane's commands as this agent applies them: at most once by id, acknowledged in the next heartbeat.

The control plane repeats a command until the agent's ack reaches it, so a
command id already applied (the journal survives restarts) is acknowledged
again, never re-applied. A command that fails is left unacknowledged, so the
control plane sends it again and the next try may succeed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import llmgw_wire as wire
from llmgw_agent.client import ControlPlane, Refused
from llmgw_agent.probe import Probe
from llmgw_agent.state import AppliedJournal, CredentialFile
from llmgw_agent.supervisor import Supervisor
from llmgw_wire import engines as wire_engines

log = logging.getLogger("llmgw.agent")

# Shards started per answer of the control plane; the rest wait (unacknowledged, so
# repeated) for the next heartbeat. A control plane gone wrong then starts a
# handful of engines a heartbeat, not hundreds in seconds.
MAX_STARTS_PER_ANSWER = 8

WireCommand = wire.StartShard | wire.StopShard | wire.ScanFabric | wire.InstallEngine


class Commands:
    """Applies one node's commands and collects the acknowledgements its next heartbeat carries."""

    def __init__(
        self,
        *,
        node_id: str,
        supervisor: Supervisor,
        probe: Probe,
        control_plane: ControlPlane,
        credential: CredentialFile,
        journal: AppliedJournal,
        clock: Callable[[], float],
    ) -> None:
        self.node_id = node_id
        self.supervisor = supervisor
        self.probe = probe
        self.control_plane = control_plane
        self.credential = credential
        self.journal = journal
        self.clock = clock
        # What InstallEngine commands were answered with, reported in every heartbeat.
        self.installs: dict[str, wire.EngineInstall] = {}
        # The engines discovery found (set at each registration).
        self.engine_versions: dict[str, str] = {}
        self._acks: dict[str, None] = {}
        self._inflight: set[str] = set()
        self._lock = threading.Lock()

    def acks(self) -> list[str]:
        """The ids to acknowledge in the next heartbeat (at most what one may carry)."""
        with self._lock:
            return list(self._acks)[: wire.MAX_COMMANDS]

    def acknowledged(self, ids: Iterable[str]) -> None:
        """The control plane took these acknowledgements: they need not be sent again."""
        with self._lock:
            for a in ids:
                self._acks.pop(a, None)

    def apply_all(self, cmds: list[WireCommand]) -> int:
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
            if cmd.id and (cmd.id in self.journal or cmd.id in self._inflight):
                return False
        existing = self.supervisor.shards.get(cmd.shard_id)
        return existing is None or existing.st in (wire.ShardState.STOPPED, wire.ShardState.FAILED)

    def apply(self, cmd: WireCommand) -> None:
        """Apply one command once: a command id seen before is acknowledged again, not re-applied."""
        if cmd.id:
            with self._lock:
                if cmd.id in self.journal:
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
                answer = self.install_state(cmd)
                self.installs[answer.engine] = answer
                log.info("command %s: engine %s is %s", cmd.id, answer.engine, answer.state)
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

    def _mark_applied(self, cmd_id: str) -> None:
        with self._lock:
            self.journal.record(cmd_id, self.clock())
            self._acks[cmd_id] = None

    def install_state(self, cmd: wire.InstallEngine) -> wire.EngineInstall:
        """An honest answer to an install request: this agent does not install engines, it reports them."""
        return install_answer(cmd, self.engine_versions)

    def _scan(self, cmd: wire.ScanFabric) -> None:
        started = time.monotonic()
        try:
            result = self.probe.ibnetdiscover(hca=cmd.hca, port=cmd.port, timeout=cmd.timeout_s)
            upload = wire.ScanUpload(
                node_id=self.node_id,
                command_id=cmd.id,
                key=cmd.key,
                hca=cmd.hca,
                port=cmd.port,
                output=(result.stdout or "") if result.ok else "",
                error="" if result.ok else (result.error or "ibnetdiscover failed")[:4000],
                took_s=round(time.monotonic() - started, 3),
            )
            r = self.control_plane.post("/api/v1/agent/scans", upload, self.credential.read())
            if r.status_code not in (200, 201, 202):
                raise Refused(f"scan upload refused: {self.control_plane.why(r)}")
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


def install_answer(cmd: wire.InstallEngine, engine_versions: dict[str, str]) -> wire.EngineInstall:
    """What an agent that found `engine_versions` answers an InstallEngine with: ready, or unsupported and why."""
    # Canonical names on both sides: asked for `llamacpp`, an agent that found `llama-server` has it.
    known = wire_engines.ENGINES.get(wire_engines.canonical(cmd.engine))
    engine = known.name if known else cmd.engine
    have = wire_engines.canonical_versions(engine_versions).get(engine, "")
    # Versions as the registry reads them: a profile asking for llama.cpp "4589" means the build "b4589".
    same = known.version(have).text == known.version(cmd.version).text if known else have == cmd.version
    if have and (not cmd.version or same):
        return wire.EngineInstall(engine=engine, version=have, variant=cmd.variant, state="ready")
    wanted = f"{known.label if known else engine}{f' {cmd.version}' if cmd.version else ''}"
    probe = f" so that `{' '.join(known.probe.argv)}` answers" if known and known.probe else ""
    detail = (
        f"this agent does not install engines; install {wanted} on the node{probe} (found: {have or 'none'}), "
        "then restart the agent"
    )
    return wire.EngineInstall(
        engine=engine, version=cmd.version, variant=cmd.variant, state="unsupported", detail=detail
    )
