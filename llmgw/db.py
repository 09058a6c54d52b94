"""Database helpers for the few statements that run on every agent request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

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
    if connection.vendor != "postgresql":
        with connection.cursor() as cur:
            yield cur
        return
    import psycopg

    connection.ensure_connection()
    conn = connection.connection
    if conn.prepare_threshold is None:
        # Django turns preparation off for the connection; only cursors that
        # bind on the server (these) ever prepare, so turning it on here
        # changes nothing for the ORM's own cursors.
        conn.prepare_threshold = PREPARE_THRESHOLD
    with connection.wrap_database_errors:
        raw = psycopg.Cursor(conn)
    cur = connection.make_debug_cursor(raw) if connection.queries_logged else connection.make_cursor(raw)
    with cur:
        yield cur
