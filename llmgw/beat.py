"""One Celery beat in the cluster, however many are started.

Two beats (two `make run`s on one database, a second host) double every
periodic task. Each beat runs this scheduler; only the one holding the
"beat" lock (llmgw/locks.py: a PostgreSQL advisory lock on a session of its
own, or a file lock on SQLite) sends anything. The others wait and take over
within LOCK_RETRY_S of the holder's death, since the lock dies with it.
"""

from __future__ import annotations

import logging

from celery.beat import PersistentScheduler

from llmgw.locks import HeldLock

log = logging.getLogger(__name__)

# How often a standby beat asks for the lock.
LOCK_RETRY_S = 5.0


class LockedScheduler(PersistentScheduler):
    """Celery's file-backed scheduler that sends tasks only while it holds the cluster's beat lock."""

    def __init__(self, *args, **kwargs) -> None:
        self.lock = HeldLock("beat")
        self.leading = False
        super().__init__(*args, **kwargs)

    def tick(self, *args, **kwargs) -> float:
        """One scheduler step if this beat leads; otherwise wait and ask for the lock again."""
        if not self.lock.held():
            if self.leading:
                log.warning("beat lock lost; standing by")
            self.leading = False
            return LOCK_RETRY_S
        if not self.leading:
            log.info("holding the beat lock: this beat sends the periodic tasks")
            self.leading = True
        return super().tick(*args, **kwargs)

    def close(self) -> None:
        """Save the schedule and let the lock go."""
        super().close()
        self.lock.close()
