"""A server worker leaves when its master is gone.

granian's workers are processes of its master. Killed (SIGKILL, the OOM
killer), the master cannot stop them: they go on serving on the shared
socket beside the master started in its place, with old code and settings,
and hold the port when that one stops. Each worker therefore watches its
parent and, once another process has become it, stops itself as a master
would stop it (SIGTERM), then, if that has not ended it, exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

CHECK_S = 1.0
# A worker asked to stop finishes the requests it holds within this, as under its master's SIGTERM.
GRACE_S = 10.0

_started = False


def watch_parent(*, check_s: float = CHECK_S, grace_s: float = GRACE_S) -> None:
    """Start this process's watch of its parent (once): SIGTERM itself when the parent is gone."""
    global _started
    if _started:
        return
    _started = True
    # The master that started this worker, as multiprocessing recorded it at the start: by
    # the time this runs (the application's start-up, seconds later) it may be dead already.
    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None and spawner.pid else os.getppid()
    threading.Thread(target=_watch, args=(parent, check_s, grace_s), name="orphan-watch", daemon=True).start()


def _watch(parent: int, check_s: float, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(check_s)
    log.warning("the server's master (pid %d) is gone: worker %d stops", parent, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)
