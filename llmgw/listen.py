"""A listening socket that outlives the server's master: nothing refused while a master or a worker is replaced.

granian binds a socket of its own in each worker (SO_REUSEPORT), and only
while its master lives. Two losses followed. A worker that died took its
socket's queue with it, so connections the kernel had handed it were reset,
and new ones refused, until its replacement had loaded the application.
A master killed (SIGKILL, the OOM killer) left the port to its orphaned
workers until they noticed (llmgw/orphans.py); the master started in its
place found the port held and exited, and `make run` started it again with
a doubling pause: the service was down 35-41 s, and every connection meanwhile
was refused.

So the socket is bound once, by a small process that does nothing else and
keeps it open (`hold`), and the server is its child, given that socket
(`serve`: granian, every worker accepting on the one socket). The holder
starts a master that was killed again at once; connections that arrive in
between wait in the socket's backlog and are answered by the new workers
(or the old ones until they leave) instead of being refused. A master that
exits by itself (a setting it refused, a port it could not use) is not
started again here: the holder exits with its status, for `make run`
(scripts/run-all.sh) or the service manager to judge.

    python -m llmgw.listen hold HOST:PORT -- COMMAND...   # COMMAND finds the socket in LLMGW_LISTEN_FD
    python -m llmgw.listen serve GRANIAN-ARGUMENTS...     # granian on LLMGW_LISTEN_FD (or systemd's LISTEN_FDS)

The same socket serves gunicorn (`--bind fd://N`). Under systemd, a socket
unit holds the socket instead (LISTEN_FDS; docs/operations.md).

    python -m llmgw.listen hold HOST:PORT --sockets N -- COMMAND...

holds N sockets on the port instead (SO_REUSEPORT), one for each of granian's
N workers (LLMGW_LISTEN_FDS): the kernel spreads new connections over them.
On one socket that every worker accepts on, whichever worker's accept loop
woke first took the connection, and a fleet's kept-alive connections, opened
together, piled onto one worker: at 5,000 simulated nodes one web worker
spent 74 % of a core and the other 1 %, a process's threads sharing one
interpreter lock, so the web tier had one core of two. Each socket is
still the holder's: a worker that dies leaves its connections waiting in its
socket's backlog for its replacement, refused by no one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from granian._granian import SocketHolder
from granian.cli import entrypoint
from granian.server import Server

from llmgw import orphans

USAGE = """\
    python -m llmgw.listen hold HOST:PORT [--sockets N] -- COMMAND...   # COMMAND finds the socket in LLMGW_LISTEN_FD
    python -m llmgw.listen serve GRANIAN-ARGUMENTS...     # granian on LLMGW_LISTEN_FD (or systemd's LISTEN_FDS)"""
ENV_FD = "LLMGW_LISTEN_FD"
# Every socket held, comma-separated, when there are several (one for each worker); ENV_FD names the first.
ENV_FDS = "LLMGW_LISTEN_FDS"
# systemd's socket passing: the first passed socket is always fd 3 (sd_listen_fds(3)).
SD_LISTEN_FDS_START = 3
BACKLOG = 1024
KILL_TIMEOUT_FLAG = "--workers-kill-timeout"


def bind(addr: str, *, backlog: int = BACKLOG, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on HOST:PORT, inheritable; OSError naming the address when it cannot be had.

    Without SO_REUSEPORT: a port another program holds (granian binds with
    it) is refused here rather than shared with it. With it (`reuse_port`),
    for the holder's own group of sockets on one port (bind_group).
    """
    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, ValueError) as e:
        raise OSError(f"{addr} is not an address to listen on ({e})") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"{addr} cannot be listened on: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def bind_group(addr: str, count: int, *, backlog: int = BACKLOG) -> list[socket.socket]:
    """`count` listening sockets on one HOST:PORT (SO_REUSEPORT), the kernel spreading connections over them.

    The port is first bound without SO_REUSEPORT and let go, so that a port
    another program holds is refused (as bind does) rather than joined.
    """
    if count <= 1:
        return [bind(addr, backlog=backlog)]
    probe = bind(addr, backlog=1)
    port = probe.getsockname()[1]
    probe.close()
    host = addr.rpartition(":")[0]
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            held.append(bind(f"{host}:{port}", backlog=backlog, reuse_port=True))
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


def inherited_fds(environ: dict[str, str] | None = None) -> list[int]:
    """Every socket the holder gave this process, one for each worker (LLMGW_LISTEN_FDS); [] when not several."""
    raw = os.environ.get(ENV_FDS, "") if environ is None else environ.get(ENV_FDS, "")
    return [int(f) for f in raw.split(",") if f.strip()]


def only_socket(environ: dict[str, str] | None = None) -> int | None:
    """inherited_fd for a server that accepts on one socket (the gateway's own): SystemExit when several are held.

    Held with --sockets N, the kernel hands each socket its share of the
    connections: those of a socket nobody accepts on would wait for good.
    """
    fds = inherited_fds(environ)
    if len(fds) > 1:
        raise SystemExit(
            f"llmgw: this server accepts on one listening socket, but its holder keeps {len(fds)} "
            f"({ENV_FDS}): run `python -m llmgw.listen hold` without --sockets for it"
        )
    return inherited_fd(environ)


def inherited_fd(environ: dict[str, str] | None = None, *, pid: int | None = None) -> int | None:
    """The listening socket this process was given: LLMGW_LISTEN_FD, or systemd's first; None when none."""
    env = os.environ if environ is None else environ
    if env.get(ENV_FD):
        return int(env[ENV_FD])
    if env.get("LISTEN_FDS") and env.get("LISTEN_PID") == str(os.getpid() if pid is None else pid):
        if int(env["LISTEN_FDS"]) != 1:
            raise ValueError(f"LISTEN_FDS is {env['LISTEN_FDS']}: one listening socket is served, not more")
        return SD_LISTEN_FDS_START
    return None


def hold(addr: str, command: list[str], *, sockets: int = 1, restart_pause_s: float = 0.2) -> int:
    """Bind `addr`, then run `command` with it (LLMGW_LISTEN_FD) and again whenever it is killed; its exit status.

    `sockets` > 1 holds that many on the port, one for each worker
    (LLMGW_LISTEN_FDS; bind_group). SIGTERM or SIGINT here is passed to the
    command, and ends the hold once the command has exited.
    """
    try:
        held = bind_group(addr, sockets)
    except OSError as e:
        print(f"llmgw: {e}", file=sys.stderr, flush=True)
        return 1
    fds = [sock.fileno() for sock in held]
    # Where the server's workers mark themselves ready: an orphaned worker serves on until one
    # of its successors has (llmgw/orphans.py).
    ready = tempfile.mkdtemp(prefix="llmgw-ready-")
    env = {**os.environ, ENV_FD: str(fds[0]), orphans.ENV_READY: ready, orphans.ENV_HOLDER: str(os.getpid())}
    if len(fds) > 1:
        env[ENV_FDS] = ",".join(map(str, fds))
    try:
        return _run(addr, command, env, fds, restart_pause_s)
    finally:
        shutil.rmtree(ready, ignore_errors=True)


def _run(addr: str, command: list[str], env: dict[str, str], fds: list[int], restart_pause_s: float) -> int:
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        child = subprocess.Popen(command, env=env, pass_fds=tuple(fds))
        if stopping:  # asked to stop while this one started: it is told too
            child.send_signal(signal.SIGTERM)
        rc = child.wait()
        if stopping:
            return 0 if rc in (0, -signal.SIGTERM) else rc
        if rc >= 0:
            # It chose to exit (an error it has said): not a death to hide by starting it again.
            print(f"llmgw: the server on {addr} exited (status {rc})", file=sys.stderr, flush=True)
            return rc
        print(
            f"llmgw: the server on {addr} was killed ({signal.Signals(-rc).name}); starting it again, "
            "its socket kept open meanwhile",
            file=sys.stderr,
            flush=True,
        )
        # A pause so short no client notices, long enough that a master killed as it starts is no busy loop.
        time.sleep(restart_pause_s)


def serve(argv: list[str]) -> None:
    """granian's command line, serving on the inherited socket (granian binds its own when none was given)."""
    fd = inherited_fd()
    if fd is not None:
        _use_socket(fd, inherited_fds() or [fd])
        if os.environ.get(ENV_FD):
            # Its holder gone, this master leaves (as a master asked to), its socket's last user.
            orphans.watch_parent(handover=False)
    sys.argv = ["granian", *granian_args(argv, os.environ)]
    entrypoint()


def granian_args(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """granian's arguments with a bound on a worker's stop: `--workers-kill-timeout` unless one was given.

    granian's master waits for each worker it asks to stop for as long as it
    takes, and a worker can miss the request: one signalled while it started
    or stopped (SIGTERM to the whole process group, as a service manager
    sends it) sat in its event loop for good, and its master, the holder and
    the service's stop with it. Killed after orphans.GRACE_S, the grace the
    servers give requests in hand, it cannot hold a restart.
    """
    given = any(a == KILL_TIMEOUT_FLAG or a.startswith(KILL_TIMEOUT_FLAG + "=") for a in argv)
    if given or env.get("GRANIAN_WORKERS_KILL_TIMEOUT"):
        return list(argv)
    return [*argv, KILL_TIMEOUT_FLAG, str(int(orphans.GRACE_S))]


def _use_socket(fd: int, fds: list[int]) -> None:
    # granian (2.x) on Linux has each worker bind its own SO_REUSEPORT socket from a spec;
    # elsewhere it shares one socket, held in `_shd`, with every worker: that path, given our
    # fd, or worker i given the i-th of the holder's sockets when it holds one for each.
    spawn = Server._spawn_worker

    def _init_shared_socket(self) -> None:
        self._ssp = None
        if len(fds) > self.workers:
            # The kernel hands every socket of the group its share: one no worker accepts on would hold
            # its connections unanswered for good.
            raise SystemExit(
                f"llmgw: {len(fds)} listening sockets held for {self.workers} worker(s): "
                "hold with --sockets equal to --workers"
            )
        self._holders = [SocketHolder(f, False, self.backlog) for f in fds]
        self._shd = self._holders[0]
        self._sfd = self._shd.get_fd()
        self._sso = None
        with socket.socket(fileno=os.dup(fd)) as sock:
            self.bind_addr, self.bind_port = sock.getsockname()[:2]

    def _spawn_worker(self, idx: int, target: object, callback_loader: object) -> object:
        # A respawned worker is given its predecessor's socket, and the connections waiting there.
        self._shd = self._holders[idx % len(self._holders)]
        self._sfd = self._shd.get_fd()
        return spawn(self, idx=idx, target=target, callback_loader=callback_loader)

    def _drop_shared_socket(self) -> None:
        # The holder keeps the sockets; the master's copies go with the master.
        pass

    Server._init_shared_socket = _init_shared_socket
    Server._spawn_worker = _spawn_worker
    Server._drop_shared_socket = _drop_shared_socket


def main(argv: list[str]) -> int:
    """`hold HOST:PORT -- COMMAND...` or `serve GRANIAN-ARGUMENTS...`."""
    if argv[:1] == ["hold"] and len(argv) >= 4 and argv[2] == "--":
        return hold(argv[1], argv[3:])
    if argv[:1] == ["hold"] and len(argv) >= 6 and argv[2] == "--sockets" and argv[4] == "--":
        if not argv[3].isdigit() or not 1 <= int(argv[3]) <= 64:
            print(f"llmgw: --sockets {argv[3]!r}: a number of sockets from 1 to 64", file=sys.stderr)
            return 2
        return hold(argv[1], argv[5:], sockets=int(argv[3]))
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
