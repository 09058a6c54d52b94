"""A server worker leaves when its master is gone.

granian's workers are processes of its master. Killed (SIGKILL, the OOM
killer), the master cannot stop them: they go on serving on the shared
socket beside the master started in its place, with old code and settings,
and hold the port when that one stops. Each worker therefore watches its
parent and, once another process has become it, stops itself as a master
would stop it (SIGTERM), then, if that has not ended it, exits.

The master does the same with the process that holds its listening socket
(llmgw/listen.py): a master left without it would serve on a socket no one
could take over.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_S = 1.0
# A worker asked to stop finishes the requests it holds within this, as under its master's SIGTERM.
GRACE_S = 10.0
# An orphan on a held socket serves until its successors are ready, or this long at most.
HANDOVER_S = 60.0

# Set by the socket's holder (llmgw/listen.py) for the server it runs: where each worker marks
# itself ready (a file named by its pid), and the holder's pid.
ENV_READY = "LLMGW_LISTEN_READY"
ENV_HOLDER = "LLMGW_LISTEN_HOLDER"

# The process whose watch is started: a worker forked from a watching master must start its own.
_started_in = 0


def watch_parent(*, check_s: float = CHECK_S, grace_s: float = GRACE_S, handover: bool = True) -> None:
    """Start this process's watch of its parent (once): SIGTERM itself when the parent is gone.

    Called as a worker's application starts (it is ready to serve then). On a
    socket held apart from the server (llmgw/listen.py), with `handover`, the
    worker marks itself ready, and once orphaned serves on until a worker of
    the master started in its master's place is ready: the socket is never
    left without a worker accepting on it.
    """
    global _started_in
    if _started_in == os.getpid():
        return
    _started_in = os.getpid()
    # The master that started this worker, as multiprocessing recorded it at the start: by
    # the time this runs (the application's start-up, seconds later) it may be dead already.
    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None and spawner.pid else os.getppid()
    ready = Path(os.environ[ENV_READY]) if handover and os.environ.get(ENV_READY) else None
    holder = int(os.environ.get(ENV_HOLDER) or 0)
    if ready is not None:
        with contextlib.suppress(OSError):
            (ready / str(os.getpid())).touch()
    # Without the hand-over, a master watching the socket's holder (llmgw/listen.py).
    what = "the server's master" if handover else "the process holding the server's socket"
    threading.Thread(
        target=_watch, args=(parent, check_s, grace_s, ready, holder, what), name="orphan-watch", daemon=True
    ).start()


def _watch(parent: int, check_s: float, grace_s: float, ready: Path | None, holder: int, what: str) -> None:
    while os.getppid() == parent:
        time.sleep(check_s)
    if ready is not None and holder:
        end = time.monotonic() + HANDOVER_S
        while not successor_ready(ready, holder=holder, dead=parent) and time.monotonic() < end:
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            (ready / str(os.getpid())).unlink()
    log.warning("%s (pid %d) is gone: process %d stops", what, parent, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def successor_ready(ready: Path, *, holder: int, dead: int) -> bool:
    """Whether a worker marked ready in `ready` is a live child of a master of `holder` other than `dead`.

    True also when the holder itself is gone: no successor will come.
    """
    if not Path(f"/proc/{holder}").exists():
        return True
    with contextlib.suppress(OSError):
        for mark in ready.iterdir():
            if not mark.name.isdigit():
                continue
            master = _ppid(int(mark.name))
            if master and master != dead and _ppid(master) == holder:
                return True
    return False
