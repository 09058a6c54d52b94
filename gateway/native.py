"""The gateway's process on its native server (gateway/dataplane/server.py): `python -m gateway.native`.

The same ASGI application as gateway/asgi.py (the data plane and the agents'
paths mounted in front of it), served by an HTTP/1.1 server on the worker's
own event loop instead of granian. Its process model is granian's as
scripts/gateway.sh runs it: a master and `--workers` worker processes
accepting on one listening socket, a worker that dies started again after a
second, SIGTERM or SIGINT passed to the workers, which finish what they hold.
The socket is the one llmgw/listen.py holds (LLMGW_LISTEN_FD, or systemd's),
else bound here on --host and --port.

    python -m gateway.native [--host H] [--port P] [--workers N] [--access-log] [--log-level LEVEL]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time

from django.conf import settings

from gateway.asgi import app
from gateway.dataplane import server
from llmgw import listen, orphans

log = logging.getLogger("gateway.server")

# A worker that died is started again after this pause, as granian's --respawn-interval 1.
RESPAWN_S = 1.0
# How long the master waits for its workers to finish after passing them a SIGTERM.
STOP_S = 30.0


def _worker(sock: socket.socket, access_log: bool) -> None:
    # The master's handlers are not the worker's: its event loop installs its own.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.run(app, sock, head_timeout=settings.LLMGW_BODY_TIMEOUT, access_log=access_log)


def serve(sock: socket.socket, workers: int, access_log: bool) -> int:
    """Run `workers` worker processes on `sock`, each started again when it dies, until SIGTERM or SIGINT."""
    # Forked, not spawned: a worker starts with the application already imported, and sees the master
    # as its parent (llmgw/orphans.py watches it).
    ctx = multiprocessing.get_context("fork")
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start() -> multiprocessing.Process:
        p = ctx.Process(target=_worker, args=(sock, access_log), name="gateway-worker")
        p.start()
        return p

    procs = [start() for _ in range(workers)]
    died: dict[int, float] = {}
    while not stopping:
        time.sleep(0.1)
        for i, p in enumerate(procs):
            if p.is_alive() or stopping:
                continue
            if i not in died:
                log.warning("gateway: worker %d exited (status %s); starting another", p.pid, p.exitcode)
                died[i] = time.monotonic() + RESPAWN_S
            elif time.monotonic() >= died[i]:
                del died[i]
                procs[i] = start()
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    end = time.monotonic() + STOP_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    return 0


def main(argv: list[str]) -> int:
    """`[--host H] [--port P] [--workers N] [--access-log] [--log-level LEVEL]`: serve until stopped."""
    parser = argparse.ArgumentParser(prog="python -m gateway.native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--access-log", action="store_true")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.getLogger("gateway.server").setLevel(args.log_level.upper())
    fd = listen.only_socket()
    if fd is None:
        try:
            sock = listen.bind(f"{args.host}:{args.port}")
        except OSError as e:
            print(f"llmgw: {e}", file=sys.stderr, flush=True)
            return 1
    else:
        sock = socket.socket(fileno=fd)
        if os.environ.get(listen.ENV_FD):
            # Its holder gone, this master leaves (as a master asked to), its socket's last user.
            orphans.watch_parent(handover=False)
    sock.setblocking(False)
    return serve(sock, max(1, args.workers), args.access_log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
