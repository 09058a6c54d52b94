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

from granian._granian import SocketHolder
from granian.cli import entrypoint
from granian.server import Server

from llmgw import orphans

ENV_FD = "LLMGW_LISTEN_FD"
# systemd's socket passing: the first passed socket is always fd 3 (sd_listen_fds(3)).
SD_LISTEN_FDS_START = 3
BACKLOG = 1024


def bind(addr: str, *, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on HOST:PORT, inheritable; OSError naming the address when it cannot be had.

    Without SO_REUSEPORT: a port another program holds (granian binds with
    it) is refused here rather than shared with it.
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
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"{addr} cannot be listened on: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


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


def hold(addr: str, command: list[str], *, restart_pause_s: float = 0.2) -> int:
    """Bind `addr`, then run `command` with it (LLMGW_LISTEN_FD) and again whenever it is killed; its exit status.

    SIGTERM or SIGINT here is passed to the command, and ends the hold once
    the command has exited.
    """
    try:
        sock = bind(addr)
    except OSError as e:
        print(f"llmgw: {e}", file=sys.stderr, flush=True)
        return 1
    fd = sock.fileno()
    # Where the server's workers mark themselves ready: an orphaned worker serves on until one
    # of its successors has (llmgw/orphans.py).
    ready = tempfile.mkdtemp(prefix="llmgw-ready-")
    env = {**os.environ, ENV_FD: str(fd), orphans.ENV_READY: ready, orphans.ENV_HOLDER: str(os.getpid())}
    try:
        return _run(addr, command, env, fd, restart_pause_s)
    finally:
        shutil.rmtree(ready, ignore_errors=True)


def _run(addr: str, command: list[str], env: dict[str, str], fd: int, restart_pause_s: float) -> int:
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        child = subprocess.Popen(command, env=env, pass_fds=(fd,))
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
        _use_socket(fd)
        if os.environ.get(ENV_FD):
            # Its holder gone, this master leaves (as a master asked to), its socket's last user.
            orphans.watch_parent(handover=False)
    sys.argv = ["granian", *argv]
    entrypoint()


def _use_socket(fd: int) -> None:
    # granian (2.x) on Linux has each worker bind its own SO_REUSEPORT socket from a spec;
    # elsewhere it shares one socket, held in `_shd`, with every worker: that path, given our fd.
    def _init_shared_socket(self) -> None:
        self._ssp = None
        self._shd = SocketHolder(fd, False, self.backlog)
        self._sfd = self._shd.get_fd()
        self._sso = None
        with socket.socket(fileno=os.dup(fd)) as sock:
            self.bind_addr, self.bind_port = sock.getsockname()[:2]

    def _drop_shared_socket(self) -> None:
        # The holder keeps the socket; the master's copy goes with the master.
        pass

    Server._init_shared_socket = _init_shared_socket
    Server._drop_shared_socket = _drop_shared_socket


def main(argv: list[str]) -> int:
    """`hold HOST:PORT -- COMMAND...` or `serve GRANIAN-ARGUMENTS...`."""
    if argv[:1] == ["hold"] and len(argv) >= 4 and argv[2] == "--":
        return hold(argv[1], argv[3:])
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 0
    print(__doc__.split("\n\n")[-2], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
