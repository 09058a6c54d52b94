"""prepared_cursor: server-side binding, prepared statements, still counted and in Django's transaction."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from llmgw.db import PREPARE_THRESHOLD, prepared_cursor

pytestmark = pytest.mark.django_db

SQL = "SELECT %s::int + 1, %s::text"


def _prepared() -> list[str]:
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        return [r[0] for r in cur.fetchall()]


def test_statements_are_counted_and_answer_like_djangos_cursor(django_assert_num_queries):
    with django_assert_num_queries(2):
        for i in range(2):
            with prepared_cursor() as cur:
                cur.execute(SQL, [i, "x"])
                assert cur.fetchone() == (i + 1, "x")


def test_a_statement_is_prepared_after_the_threshold():
    for i in range(PREPARE_THRESHOLD + 1):
        with prepared_cursor() as cur:
            cur.execute(SQL, [i, "y"])
    assert "SELECT $1::int + 1, $2::text" in _prepared()


def test_it_runs_in_djangos_transaction(now):
    from inventory.models import Node
    from tests.factories import make_node

    make_node("node-a", now=now)
    with pytest.raises(RuntimeError), transaction.atomic():
        with prepared_cursor() as cur:
            cur.execute(f"UPDATE {Node._meta.db_table} SET hostname = %s WHERE id = %s", ["changed", "node-a"])
        raise RuntimeError("roll back")
    assert Node.objects.get(id="node-a").hostname != "changed"
