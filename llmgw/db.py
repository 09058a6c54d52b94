"""Database helpers for the few statements that run on every agent request."""

from __future__ import annotations

import select
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, Model
from django.db.models.fields import AutoFieldMixin
from django.utils import timezone
from pydantic_core import to_json

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


def _unwritable(value: object) -> object:
    raise TypeError(f"cannot write a {type(value).__name__} in a row")


def json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows (column -> value) as the JSON document `jsonb_populate_recordset` reads into a table's row type.

    Datetimes keep their microseconds (Django's own JSON encoder drops them), UUIDs and decimals are
    written as text, what a column's input function reads back exactly. Serialized by pydantic's
    encoder, not the standard library's: a scale-up's batch is thousands of UUIDs and datetimes, each
    a call back into Python there, a fifth of the batch's time in the writer.
    """
    return to_json(rows, fallback=_unwritable).decode()


def insert_together(objs: Sequence[Model]) -> None:
    """Insert unsaved model instances, of one model or several, in one statement.

    For a join storm: a new node's row, its events, GPUs, fabrics, storage,
    weights, engine installs and credential are one round trip, whose
    statement the ORM does not build each time (insert_rows says how). As
    with `save()`, `auto_now` fields are filled in; unlike it, no signals are
    sent and an automatic primary key is left unset on the instance. Other
    databases get one bulk_create per model.
    """
    groups: dict[type[Model], list[Model]] = {}
    for obj in objs:
        groups.setdefault(type(obj), []).append(obj)
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        for model, rows in groups.items():
            model.objects.bulk_create(rows)
        return
    insert_rows([(model, columns_of(rows)) for model, rows in groups.items()])


def columns_of(objs: Sequence[Model]) -> list[dict[str, Any]]:
    """Unsaved instances of one model as insert_rows takes them: column -> value, `auto_now` fields filled in."""
    if not objs:
        return []
    fields = [f for f in type(objs[0])._meta.concrete_fields if not isinstance(f, AutoFieldMixin)]
    return [{f.column: f.pre_save(obj, True) for f in fields} for obj in objs]


def insert_rows(tables: Sequence[tuple[type[Model], Sequence[Mapping[str, Any]]]]) -> None:
    """Insert rows given as column -> value mappings, of one table or several, in one statement.

    For writers of thousands of rows at once (a scale-up's placements): no
    model instance is built per row, and no parameter per value is quoted.
    On PostgreSQL each table's rows travel as one JSON document, read into
    the table's own row type (`jsonb_populate_recordset`, so every column is
    parsed by its type's input function and every constraint holds), one
    INSERT per table joined as data-modifying CTEs, in the order given (a
    row may name one of an earlier table's in the same call). Values are
    what JSON carries, plus datetimes, UUIDs and decimals. A column a row
    leaves out gets its field's default, drawn once per call (per row for a
    primary or unique key, whose default is drawn to differ), or the current
    time for an `auto_now` field; an automatic primary key left out is
    drawn by the database. Other databases get one bulk_create per table.
    Raises ValueError naming a key that is no column of its table.
    """
    db = connections[DEFAULT_DB_ALIAS]
    now = timezone.now()
    prepared: list[tuple[type[Model], list[Field], list[dict[str, Any]]]] = []
    for model, rows in tables:
        if not rows:
            continue
        by_column = {f.column: f for f in model._meta.concrete_fields}
        given: set[str] = set().union(*(r.keys() for r in rows))
        unknown = sorted(given - set(by_column))
        if unknown:
            raise ValueError(f"{model._meta.label} has no column {unknown[0]!r}")
        fields = [f for f in by_column.values() if f.column in given or not isinstance(f, AutoFieldMixin)]
        fill: dict[str, Any] = {}
        each: list[Field] = []
        for f in fields:
            if f.column in given and all(f.column in r for r in rows):
                continue
            if getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False):
                fill[f.column] = now
            elif f.primary_key or f.unique:
                each.append(f)
            else:
                fill[f.column] = f.get_default()
        full = [{**fill, **{f.column: f.get_default() for f in each if f.column not in r}, **r} for r in rows]
        prepared.append((model, fields, full))
    if not prepared:
        return
    if db.vendor != "postgresql":
        for model, fields, rows in prepared:
            model.objects.bulk_create([model(**{f.attname: r[f.column] for f in fields}) for r in rows])
        return
    quote = db.ops.quote_name
    inserts, params = [], []
    for model, fields, rows in prepared:
        table = quote(model._meta.db_table)
        columns = ", ".join(quote(f.column) for f in fields)
        inserts.append(
            f"INSERT INTO {table} ({columns}) SELECT {columns} FROM jsonb_populate_recordset(NULL::{table}, %s::jsonb)"
        )
        params.append(json_rows(rows))
    *first, last = inserts
    sql = ("WITH " + ", ".join(f"i{k} AS ({s})" for k, s in enumerate(first)) + " " if first else "") + last
    with prepared_cursor() as cur:
        cur.execute(sql, params)


def reserve_ids(model: type[Model], count: int) -> list[int]:
    """`count` values of a model's automatic primary key, drawn before its rows are inserted (insert_rows).

    So that rows of another table can name them in the same statement (an
    allocation's GPUs name the allocation). PostgreSQL draws them from the
    key's sequence, as an insert would: a value drawn is never drawn again,
    committed or not. SQLite has no sequence: the values follow the highest
    ever drawn, which holds only while the caller's transaction holds the
    write lock (llmgw's SQLite transactions take it as they begin), so it
    must be called in one.
    """
    if count <= 0:
        return []
    db = connections[DEFAULT_DB_ALIAS]
    table, pk = model._meta.db_table, model._meta.pk.column
    quote = db.ops.quote_name
    with db.cursor() as cur:
        if db.vendor == "postgresql":
            sql = "SELECT nextval(pg_get_serial_sequence(%s, %s)) FROM generate_series(1, %s)"
            cur.execute(sql, [table, pk, count])
            return [row[0] for row in cur.fetchall()]
        if not db.in_atomic_block:
            raise RuntimeError("reserve_ids on SQLite must run in the transaction that inserts the rows")
        cur.execute(f"SELECT COALESCE(MAX({quote(pk)}), 0) FROM {quote(table)}")
        (top,) = cur.fetchone()
        cur.execute("SELECT seq FROM sqlite_sequence WHERE name = %s", [table])
        seq = cur.fetchone()
        top = max(top, seq[0] if seq else 0)
    return list(range(top + 1, top + 1 + count))
