"""Cluster-wide single-flight locks that a dead holder cannot keep.

On PostgreSQL a lock is a session advisory lock: the database drops it the
moment its holder's connection ends, so a worker killed with SIGKILL
mid-pass blocks nobody (a cache key with a TTL blocked every pass for its
whole TTL, and its add-then-get-then-delete release could free another
holder's lock). On SQLite, the embedded single-host default, it is an
`flock` on a file under LLMGW_VAR_DIR, which the kernel drops when the
holding process dies.

Session advisory locks need a session of their own: behind a transaction-
pooling PgBouncer, point these processes at PostgreSQL directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection


def lock_key(name: str) -> int:
    """A stable signed 64-bit key for a lock name (PostgreSQL's advisory lock space)."""
    return int.from_bytes(hashlib.sha256(f"llmgw:{name}".encode()).digest()[:8], "big", signed=True)


def _lock_path(name: str) -> Path:
    path = Path(settings.VAR_DIR) / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class FileLock:
    """An exclusive, non-blocking flock on a file; released by close() or by the process's death."""

    def __init__(self, name: str) -> None:
        self.path = _lock_path(name)
        self.fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock if free; True when held."""
        if self.fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        """Let the lock go."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def single_flight(name: str) -> Iterator[bool]:
    """Hold the cluster-wide lock `name` for the block, if free; yields whether it is held.

    Uses Django's default connection on PostgreSQL (the lock ends with the
    session, whatever happens to the process), a file lock elsewhere.
    """
    if connection.vendor == "postgresql":
        key = lock_key(name)
        with connection.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s)", [key])
            held = bool(cur.fetchone()[0])
        try:
            yield held
        finally:
            if held:
                with contextlib.suppress(Exception), connection.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s)", [key])
        return
    lock = FileLock(name)
    held = lock.acquire()
    try:
        yield held
    finally:
        lock.release()


class HeldLock:
    """A lock held for a long-lived process's whole life (one beat in the cluster).

    PostgreSQL: an advisory lock on a connection of its own, outside Django's
    connection handling (which closes connections between tasks); checked on
    every call, since a database restart ends the session and with it the
    lock. Elsewhere: a FileLock.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.conn: Any = None
        self.file: FileLock | None = None

    def held(self) -> bool:
        """Whether this process holds the lock now, taking it if it is free."""
        if connection.vendor != "postgresql":
            self.file = self.file or FileLock(self.name)
            return self.file.acquire()
        if self.conn is not None:
            try:
                self.conn.execute("SELECT 1")
                return True
            except Exception:
                # The session ended (a database restart): the lock went with it.
                self.close()
        try:
            params = connection.get_connection_params()
            params.pop("cursor_factory", None)
            params.pop("context", None)
            conn = psycopg.connect(**params, autocommit=True)
        except Exception:
            return False
        if conn.execute("SELECT pg_try_advisory_lock(%s)", [lock_key(self.name)]).fetchone()[0]:
            self.conn = conn
            return True
        conn.close()
        return False

    def close(self) -> None:
        """Let the lock go."""
        if self.conn is not None:
            # Unlocked first: the server ends a closed session a moment after the client has gone.
            with contextlib.suppress(Exception):
                self.conn.execute("SELECT pg_advisory_unlock(%s)", [lock_key(self.name)])
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
        if self.file is not None:
            self.file.release()
