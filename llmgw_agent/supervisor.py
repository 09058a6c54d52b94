"""The engine supervisor: starts shards as child processes, watches them, stops them, adopts them.

A shard's engine runs in its own session (its own process group), so a stop
signals the whole group (vLLM's and SGLang's worker processes with it) and the
agent restarting does not take its shards down. Each shard is recorded in the
state directory (pid, the process's start time, its argv); an agent starting
again finds them, checks the pid is still the same process (a pid is reused,
a start time and command line are not), and offers them for adoption.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

import llmgw_wire as wire
from llmgw_agent import engines
from llmgw_agent.netif import interface_addr
from llmgw_agent.processes import log_tail, proc_identity, rotate_log, signal_group
from llmgw_agent.shards import TERMINAL, TRANSITIONS, S, Shard, ShardRecords, TransitionError, safe_name
from llmgw_wire import engines as wire_engines

log = logging.getLogger("llmgw.agent.supervisor")

LOG_TAIL_LINES = wire.TAIL_LINES

# Part of this module's interface: callers and tests take them from here.
__all__ = ["TERMINAL", "TRANSITIONS", "Shard", "Supervisor", "TransitionError", "proc_identity"]


class Supervisor:
    """Starts, watches, stops and adopts the shards of one node."""

    def __init__(
        self,
        state_dir: str | Path,
        *,
        engine_versions: dict[str, str] | None = None,
        mgmt_interface: str = "",
        log_max_bytes: int = 50 * 1024 * 1024,
        log_backups: int = 3,
        keep_finished_s: float = 300.0,
        health_timeout_s: float = 1.0,
        kill_grace_s: float = 10.0,
        base_env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        address_of: Callable[[str], str] = interface_addr,
    ) -> None:
        self.dir = Path(state_dir)
        self.shard_dir = self.dir / "shards"
        self.log_dir = self.dir / "logs"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.records = ShardRecords(self.shard_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engine_versions = dict(engine_versions or {})
        self.mgmt_interface = mgmt_interface
        # An interface's address, for engines that must be told which one to advertise.
        self.address_of = address_of
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.keep_finished_s = keep_finished_s
        self.health_timeout_s = health_timeout_s
        self.kill_grace_s = kill_grace_s
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.clock = clock
        self.shards: dict[str, Shard] = {}
        # What this node has (set by the agent from its own discovery); None: not known yet, not checked.
        self.gpus: frozenset[int] | None = None
        self.hcas: frozenset[str] | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        # Per shard, in memory only: the secrets its engine was started with (masked in
        # its output), and the end of its output as it was when it failed, redacted.
        self._secrets: dict[str, list[str]] = {}
        self._tails: dict[str, list[str]] = {}
        self._lock = threading.RLock()
        self._http = httpx.Client(timeout=health_timeout_s, trust_env=False)
        self._adopt()

    def log_path(self, shard_id: str) -> Path:
        """Where a shard's engine writes its output."""
        return self.log_dir / f"{safe_name(shard_id)}.log"

    def _save(self, shard: Shard) -> None:
        if shard.st in TERMINAL and not self._alive(shard):
            # Nothing left to adopt.
            self.records.remove(shard.shard_id)
            return
        self.records.write(shard)

    def _move(self, shard: Shard, new: S, *, reason: str = "") -> None:
        old = shard.st
        if new == old:
            return
        if new not in TRANSITIONS[old]:
            raise TransitionError(f"shard {shard.shard_id}: {old} -> {new} is not allowed")
        shard.state = new.value
        if reason:
            shard.reason = reason
        if new in TERMINAL:
            shard.ended_at = self.clock()
        log.info(
            "shard %s: %s -> %s%s", shard.shard_id, old.value, new.value, f" ({shard.reason})" if shard.reason else ""
        )
        self._save(shard)

    def _adopt(self) -> None:
        for path in self.records.paths():
            try:
                shard = self.records.read(path)
            except (OSError, ValueError, TypeError) as e:
                log.warning("ignoring unreadable shard record %s: %s", path.name, e)
                path.unlink(missing_ok=True)
                continue
            ident = proc_identity(shard.pid) if shard.pid else None
            # The secrets it was started with, as far as the agent can still tell.
            self._secrets[shard.shard_id] = wire.secret_values(shard.argv, self.base_env)
            if ident is None or ident[0] != shard.proc_start or ident[1] != shard.argv:
                # The pid is gone or now someone else's: the shard died while the agent was away.
                shard.adopted = True
                if shard.st not in TERMINAL:
                    shard.state = S.FAILED.value if shard.st != S.DRAINING else S.STOPPED.value
                    shard.reason = "the engine process ended while the agent was not running"
                    shard.ended_at = self.clock()
                    if shard.st == S.FAILED:
                        shard.reason = self._with_cause(shard, shard.reason)
                elif shard.st == S.FAILED:
                    self._with_cause(shard, shard.reason)  # its output's end, for statuses; its reason said why
                shard.pid = None
                self.shards[shard.shard_id] = shard
                path.unlink(missing_ok=True)
                log.warning("shard %s: %s", shard.shard_id, shard.reason)
                continue
            shard.adopted = True
            if shard.st in (S.PENDING, S.STARTING):
                shard.state = S.LOADING.value
            elif shard.st == S.FAILED:
                self._with_cause(shard, shard.reason)  # failed, still stopping: its output's end, for statuses
            self.shards[shard.shard_id] = shard
            log.info("shard %s: found running (pid %s, %s), adopting", shard.shard_id, shard.pid, shard.state)

    def _alive(self, shard: Shard) -> bool:
        """Whether the shard's process still runs; records its exit code when it has ended."""
        if shard.pid is None:
            return False
        proc = self._procs.get(shard.shard_id)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return True
            shard.exit_code = code
            self._procs.pop(shard.shard_id, None)
            return False
        try:
            # Still our child if this process started it (or a test's other Supervisor did).
            pid, status = os.waitpid(shard.pid, os.WNOHANG)
            if pid == 0:
                return True
            shard.exit_code = os.waitstatus_to_exitcode(status)
            return False
        except ChildProcessError:
            pass
        ident = proc_identity(shard.pid)
        return ident is not None and ident[0] == shard.proc_start

    def _signal(self, shard: Shard, sig: int) -> None:
        if shard.pid is not None:
            signal_group(shard.pid, sig)

    def _rotate(self, path: Path) -> None:
        rotate_log(path, self.log_backups)

    def _rotate_if_big(self, shard: Shard) -> None:
        """Rotate a running shard's log once it outgrows log_max_bytes."""
        path = self.log_path(shard.shard_id)
        try:
            if path.stat().st_size > self.log_max_bytes:
                self._rotate(path)
        except OSError as e:
            log.warning("shard %s: cannot rotate %s: %s", shard.shard_id, path, e.strerror or e)

    def log_tail(self, shard_id: str, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last lines of a shard's log, as written (secrets and all: never sent as they are)."""
        return log_tail(self.log_path(shard_id), lines)

    def _with_cause(self, shard: Shard, why: str) -> str:
        """`why` with the cause from the engine's own output; keeps that output's end, redacted, for statuses."""
        tail = wire.bounded_tail(self.log_tail(shard.shard_id), secrets=self._secrets.get(shard.shard_id, ()))
        self._tails[shard.shard_id] = tail
        return wire.with_cause(why, tail)

    def _fail(self, shard: Shard, why: str) -> None:
        """A shard whose engine ran has failed: its reason names the cause the engine itself printed."""
        self._move(shard, S.FAILED, reason=self._with_cause(shard, why))

    def _forget(self, shard_id: str) -> None:
        self.shards.pop(shard_id, None)
        self._secrets.pop(shard_id, None)
        self._tails.pop(shard_id, None)

    def start(self, cmd: wire.StartShard) -> Shard:
        """Start a shard; a shard already running under that id is left as it is (idempotent)."""
        with self._lock:
            existing = self.shards.get(cmd.shard_id)
            if existing is not None and existing.st not in TERMINAL:
                return existing
            p = cmd.profile
            shard = Shard(
                shard_id=cmd.shard_id,
                replica_id=cmd.replica_id,
                command_id=cmd.id,
                rank=cmd.rank,
                gpu_indices=list(cmd.gpu_indices),
                hcas=list(cmd.hcas),
                http_port=cmd.http_port,
                leader_addr=cmd.leader_addr,
                model=p.served_model_name or p.model_path,
                profile=p.name,
                pool=cmd.pool,
                fabric=cmd.fabric,
                profile_fp=cmd.profile_fp,
                startup_timeout_s=cmd.startup_timeout_s,
                started_at=self.clock(),
            )
            self.shards[cmd.shard_id] = shard
            self._tails.pop(cmd.shard_id, None)
            conflict = self._unfit(shard) or self._conflict(shard)
            if conflict:
                self._move(shard, S.FAILED, reason=conflict)
                return shard
            try:
                iface = cmd.mgmt_interface or self.mgmt_interface
                launch = engines.build(
                    cmd,
                    # Discovery keys versions by canonical name; "" (unknown engine) lets build say so.
                    version=self.engine_versions.get(wire_engines.canonical(p.engine), ""),
                    mgmt_interface=self.mgmt_interface,
                    host_ip=self.address_of(iface) if iface else "",
                )
            except engines.EngineError as e:
                self._move(shard, S.FAILED, reason=str(e))
                return shard
            shard.argv, shard.health_path = launch.argv, launch.health_path
            logp = self.log_path(cmd.shard_id)
            self._rotate(logp)
            env = {**self.base_env, **launch.env}
            self._secrets[cmd.shard_id] = wire.secret_values(launch.argv, env)
            fd = os.open(logp, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
            try:
                with os.fdopen(fd, "ab", buffering=0) as out:
                    # The log's end reaches the control plane when a shard fails: no secret in it.
                    out.write(f"# llmgw-agent: starting {engines.loggable_argv(launch.argv)!r}\n".encode())
                    proc = subprocess.Popen(
                        launch.argv,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                    )
            except OSError as e:
                self._move(shard, S.FAILED, reason=f"cannot start {launch.argv[0]}: {e.strerror or e}")
                return shard
            self._procs[cmd.shard_id] = proc
            shard.pid = proc.pid
            ident = proc_identity(proc.pid)
            shard.proc_start = ident[0] if ident else None
            log.info(
                "shard %s: started %s (pid %d, GPUs %s, port %s)",
                shard.shard_id,
                engines.engine_name(p),
                proc.pid,
                shard.gpu_indices,
                shard.http_port,
            )
            self._move(shard, S.STARTING)
            return shard

    def _unfit(self, new: Shard) -> str:
        """Why a shard cannot run on this node's own hardware ("" when it can).

        The control plane is trusted to place, not to be right: a StartShard
        for GPU 63 on an 8-GPU node would run with CUDA_VISIBLE_DEVICES=63
        and fail somewhere far from its cause, and one for an adapter the
        node lacks would hand NCCL a device that is not there.
        """
        if len(set(new.gpu_indices)) != len(new.gpu_indices):
            return f"GPU indices {new.gpu_indices} name a card twice"
        if self.gpus is not None:
            missing = sorted(set(new.gpu_indices) - self.gpus)
            if missing:
                return f"this node has no GPU {','.join(map(str, missing))} (it has {sorted(self.gpus)})"
        if self.hcas is not None:
            missing_hcas = sorted(set(new.hcas) - self.hcas)
            if missing_hcas:
                return f"this node has no adapter {','.join(missing_hcas)} (it has {sorted(self.hcas)})"
        live = sum(1 for o in self.shards.values() if o.shard_id != new.shard_id and o.st not in TERMINAL)
        if live >= wire.MAX_SHARDS:
            return f"this node already runs {live} shards, the most a heartbeat can report"
        return ""

    def _conflict(self, new: Shard) -> str:
        for other in self.shards.values():
            if other.shard_id == new.shard_id or (other.st in TERMINAL and not self._alive(other)):
                continue
            held = sorted(set(other.gpu_indices) & set(new.gpu_indices))
            if held:
                return f"GPU {','.join(map(str, held))} is held by shard {other.shard_id}"
            if new.http_port and other.http_port == new.http_port:
                return f"port {new.http_port} is used by shard {other.shard_id}"
        return ""

    def stop(self, shard_id: str, *, grace_s: float = 30.0, reason: str = "") -> Shard | None:
        """SIGTERM the shard's process group now, SIGKILL after the grace period (see poll)."""
        with self._lock:
            shard = self.shards.get(shard_id)
            if shard is None or shard.st in TERMINAL or shard.st == S.DRAINING:
                return shard
            if shard.st == S.PENDING:
                self._move(shard, S.STOPPED, reason=reason or "stop requested")
                return shard
            if not self._alive(shard):
                self._move(shard, S.DRAINING, reason=reason or "stop requested")
                self._move(shard, S.STOPPED)
                return shard
            self._signal(shard, signal.SIGTERM)
            shard.kill_at = self.clock() + grace_s
            self._move(shard, S.DRAINING, reason=reason or "stop requested")
            log.info("shard %s: SIGTERM sent, SIGKILL in %.0fs if still running", shard_id, grace_s)
            return shard

    def _healthy(self, shard: Shard) -> bool:
        if shard.health_path is None:
            return True
        try:
            r = self._http.get(f"http://127.0.0.1:{shard.http_port}{shard.health_path}")
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _describe_exit(self, shard: Shard) -> str:
        code = shard.exit_code
        if code is None:
            return "the engine process ended (exit code unknown: not this agent's child)"
        if code < 0:
            try:
                return f"the engine was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"the engine was killed by signal {-code}"
        return f"the engine exited with code {code}"

    def poll(self) -> None:
        """Advance every shard: exits, health, startup timeouts, SIGKILL after grace, forgetting old ones."""
        with self._lock:
            now = self.clock()
            for shard in list(self.shards.values()):
                st = shard.st
                alive = self._alive(shard)
                if alive:
                    self._rotate_if_big(shard)
                if shard.kill_at is not None and alive and now >= shard.kill_at:
                    log.warning("shard %s: still running after its grace period, SIGKILL", shard.shard_id)
                    self._signal(shard, signal.SIGKILL)
                    shard.kill_at = None
                if st in TERMINAL:
                    if not alive and shard.pid is not None:
                        shard.pid = None
                        self._save(shard)
                    if not alive and shard.ended_at is not None and now - shard.ended_at > self.keep_finished_s:
                        self._forget(shard.shard_id)
                    continue
                if st == S.DRAINING:
                    if not alive:
                        shard.kill_at = None
                        self._signal(shard, signal.SIGKILL)  # what is left of its group
                        self._move(shard, S.STOPPED, reason=shard.reason)
                    continue
                if not alive:
                    self._signal(shard, signal.SIGKILL)
                    self._fail(shard, self._describe_exit(shard))
                    continue
                if st == S.STARTING:
                    self._move(shard, S.LOADING)
                    st = S.LOADING
                if st == S.LOADING:
                    if self._healthy(shard):
                        self._move(shard, S.READY, reason="")
                        shard.reason = ""
                        self._save(shard)
                    elif now - shard.started_at > shard.startup_timeout_s:
                        self._signal(shard, signal.SIGTERM)
                        shard.kill_at = now + self.kill_grace_s
                        self._fail(shard, f"not ready after {shard.startup_timeout_s:g}s")

    def statuses(self) -> list[wire.ShardStatus]:
        """Every shard's state for a heartbeat; a failed one carries the end of its engine's output, redacted."""
        with self._lock:
            out = []
            # Live shards first: a heartbeat reports at most MAX_SHARDS, and those matter most.
            ordered = sorted(self.shards.values(), key=lambda s: s.st in TERMINAL)[: wire.MAX_SHARDS]
            for s in ordered:
                tail = self._tails.get(s.shard_id, []) if s.st == S.FAILED else []
                out.append(
                    wire.ShardStatus(
                        shard_id=s.shard_id,
                        replica_id=s.replica_id,
                        state=s.st,
                        reason=s.reason[:4000],
                        exit_code=s.exit_code if s.exit_code is None or abs(s.exit_code) <= 1024 else None,
                        http_port=s.http_port,
                        log_tail=tail,
                    )
                )
            return out

    def running(self) -> list[wire.RunningShard]:
        """The shards still running, offered for adoption at registration."""
        with self._lock:
            return [
                wire.RunningShard(
                    replica_id=s.replica_id,
                    shard_id=s.shard_id,
                    rank=s.rank,
                    gpu_indices=s.gpu_indices,
                    hcas=s.hcas,
                    http_port=s.http_port,
                    leader_addr=s.leader_addr,
                    state=s.st,
                    model=s.model,
                    profile=s.profile,
                    pool=s.pool,
                    fabric=s.fabric,
                    profile_fp=s.profile_fp,
                    pid=s.pid,
                )
                for s in self.shards.values()
                if s.st not in TERMINAL
            ]

    def pids(self) -> dict[str, int]:
        """Shard id -> pid of each running shard (for per-shard load)."""
        with self._lock:
            return {s.shard_id: s.pid for s in self.shards.values() if s.pid and s.st not in TERMINAL}

    def close(self) -> None:
        """Release the health client; the shards keep running (they outlive the agent)."""
        with contextlib.suppress(Exception):
            self._http.close()
