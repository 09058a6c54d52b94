"""Database helpers for the few statements that run on every agent request."""

from __future__ import annotations

import select
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

# Executions of one statement on a connection before psycopg prepares it (psycopg's own default).
PREPARE_THRESHOLD = 5


@contextmanager
def prepared_cursor() -> Iterator:
    """A Django cursor whose statements PostgreSQL parses and plans once per connection.

    Django binds parameters on the client by default, so PostgreSQL parses
    and plans every statement anew. This cursor binds them on the server, and
    psycopg prepares a statement once it has run PREPARE_THRESHOLD times on a
    connection: on the heartbeat's statements that halves
    PostgreSQL's work. It is still Django's cursor wrapper, in Django's
    transaction, seen by query logging and counting. Other databases get
    Django's plain cursor.
    """
    # The wrapper itself: each attribute of django.db.connection is a lookup in a context-local.
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql":
        with db.cursor() as cur:
            yield cur
        return
    import psycopg

    # As Django's own cursors do: a connection due a health check gets it
    # (and is replaced when it fails) before the statement is sent.
    db.close_if_health_check_failed()
    db.ensure_connection()
    conn = db.connection
    if conn.prepare_threshold is None:
        # Django turns preparation off for the connection; only cursors that
        # bind on the server (these) ever prepare, so turning it on here
        # changes nothing for the ORM's own cursors.
        conn.prepare_threshold = PREPARE_THRESHOLD
    with db.wrap_database_errors:
        raw = psycopg.Cursor(conn)
    cur = db.make_debug_cursor(raw) if db.queries_logged else db.make_cursor(raw)
    with cur:
        yield cur


def trust_idle_connection(alias: str = DEFAULT_DB_ALIAS, *, conn: BaseDatabaseWrapper | None = None) -> bool:
    """Count a kept-alive connection as checked when the server has said nothing on it since its last answer.

    With CONN_HEALTH_CHECKS, Django sends `SELECT 1` before a request's first
    query: a round trip that costs PostgreSQL as much as the heartbeat's own
    lease update. A server that restarts, or ends the backend, closes the
    socket (after a termination notice); an idle connection whose socket has
    nothing to read has therefore not been closed by the server. This asks
    the socket instead, without a round trip, and leaves the real check to
    Django whenever the socket has something to say. A silently dead peer
    (no FIN, e.g. a network partition) is not seen here, as it is not by
    `SELECT 1` until its timeout; the request fails and Django's
    errors-occurred check replaces the connection at the next one.

    This serves persistent connections (DATABASE_POOL_MAX=0). A pooled
    connection belongs to the pool between requests, so this answers False
    for it: the pool checks it when it hands it out. `conn`: a connection
    wrapper of its own instead of the alias's.

    Returns True when the round trip was spared.
    """
    if conn is None:
        conn = connections[alias]
    if (
        conn.connection is None
        or not conn.health_check_enabled
        or conn.health_check_done
        or conn.vendor != "postgresql"
    ):
        return False
    try:
        fd = conn.connection.fileno()
    except Exception:
        return False
    # poll, not select: a server holding thousands of client sockets has descriptors past FD_SETSIZE.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(0):
        return False
    conn.health_check_done = True
    return True


# PostgreSQL's SQLSTATE for a transaction it chose to abort to break a deadlock.
DEADLOCK = "40P01"


def is_deadlock(exc: BaseException) -> bool:
    """Whether a database error is PostgreSQL's deadlock verdict: the transaction was aborted and may run again."""
    cause = exc.__cause__ or exc
    return getattr(cause, "sqlstate", None) == DEADLOCK
