"""prepared_cursor: server-side binding, prepared statements, still counted and in Django's transaction."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import DataError, IntegrityError, connection, transaction

from llmgw.db import (
    PREPARE_THRESHOLD,
    insert_rows,
    insert_together,
    json_rows,
    prepared_cursor,
    reserve_ids,
    trust_idle_connection,
)

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


def _backend_pid() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


def _terminate(pid: int) -> None:
    import time

    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"] or None,
        dbname=db["NAME"], autocommit=True,
    ) as other:  # fmt: skip
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
        for _ in range(100):
            if not other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
                return
            time.sleep(0.01)


@pytest.fixture
def persistent():
    """A connection of its own to the test database, persistent and health-checked (DATABASE_POOL_MAX=0)."""
    from django.db.backends.postgresql.base import DatabaseWrapper

    s = dict(connection.settings_dict)
    s["OPTIONS"] = {k: v for k, v in s["OPTIONS"].items() if k != "pool"}
    s["CONN_MAX_AGE"], s["CONN_HEALTH_CHECKS"] = 600, True
    conn = DatabaseWrapper(s, alias="persistent")
    yield conn
    conn.close()


def _pid_of(conn) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_an_idle_connection_skips_the_health_check_round_trip(persistent):
    from django.test.utils import CaptureQueriesContext

    pid = _pid_of(persistent)
    # As at the start of a request: the connection is due a health check.
    persistent.close_if_unusable_or_obsolete()
    assert persistent.health_check_done is False
    assert trust_idle_connection(conn=persistent) is True
    assert persistent.health_check_done is True
    with CaptureQueriesContext(persistent) as queries:
        assert _pid_of(persistent) == pid
    assert [q["sql"] for q in queries] == ["SELECT pg_backend_pid()"]
    # Already checked: nothing more to spare.
    assert trust_idle_connection(conn=persistent) is False


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_server_ended_is_still_checked_and_replaced(persistent):
    pid = _pid_of(persistent)
    persistent.close_if_unusable_or_obsolete()
    _terminate(pid)
    # The server closed the socket: Django's own check runs, fails, and a new connection answers.
    assert trust_idle_connection(conn=persistent) is False
    assert persistent.health_check_done is False
    new_pid = _pid_of(persistent)
    assert new_pid != pid


@pytest.mark.django_db(transaction=True)
def test_a_pooled_connection_is_not_trusted_but_checked_by_the_pool():
    # The default connection is pooled: between requests it belongs to the pool.
    assert connection.settings_dict["OPTIONS"]["pool"]["max_size"] == 4
    _backend_pid()
    connection.close_if_unusable_or_obsolete()
    assert connection.connection is None
    assert trust_idle_connection() is False


# insert_together: a new node's rows of several tables in one statement.


def test_rows_of_several_tables_go_in_one_statement_exactly_as_given(django_assert_num_queries):
    from inventory.models import GPU, Node, NodeEvent

    at = dt.datetime(2026, 3, 4, 5, 6, 7, 891234, tzinfo=dt.UTC)
    node = Node(
        id="node-a",
        hostname="a.example",
        last_seen=at,
        features=["adoption"],
        agent_labels={"rack": "7"},
        cpu_flags=[],
        memory_total_mb=2**40,
        storage_reported=True,
    )
    rows = [
        node,
        NodeEvent(node_id="node-a", node_name="node-a", at=at, kind="registered", message="first", data={"n": [1]}),
        GPU(node=node, index=0, name="NVIDIA H100 80GB HBM3", nvlink_peers=[1], nic_paths={"mlx5_0": "PIX"}),
        GPU(node=node, index=1, name="NVIDIA H100 80GB HBM3", numa_node=1),
        NodeEvent(node_id="node-a", node_name="node-a", at=at, kind="credential", message="second"),
    ]
    with django_assert_num_queries(1):
        insert_together(rows)
    got = Node.objects.get(id="node-a")
    assert (got.hostname, got.last_seen, got.features, got.agent_labels, got.memory_total_mb) == (
        "a.example",
        at,
        ["adoption"],
        {"rack": "7"},
        2**40,
    )
    # Defaults and auto_now fields are filled in as save() fills them.
    assert (got.state, got.operator_labels, got.unreachable_since, got.storage_reported) == ("ready", {}, None, True)
    assert got.created_at is not None and got.updated_at is not None and got.created_at <= got.updated_at
    # Rows of one table in the order given (their ids are drawn in that order).
    assert list(NodeEvent.objects.filter(node_id="node-a").order_by("id").values_list("message", "data")) == [
        ("first", {"n": [1]}),
        ("second", {}),
    ]
    assert list(
        GPU.objects.filter(node_id="node-a")
        .order_by("index")
        .values_list("index", "nvlink_peers", "nic_paths", "numa_node")
    ) == [
        (0, [1], {"mlx5_0": "PIX"}, -1),
        (1, [], {}, 1),
    ]


def test_a_constraint_broken_by_one_row_writes_none_of_them():
    from inventory.models import GPU, Node

    node = Node(id="node-a")
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_together([node, GPU(node=node, index=0), GPU(node=node, index=0)])
    assert not Node.objects.filter(id="node-a").exists()
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_together([Node(id="node-b", cpu_count=-1)])
    assert not Node.objects.filter(id="node-b").exists()


def test_a_value_too_long_for_its_column_is_refused_not_cut():
    from inventory.models import Node

    with pytest.raises(DataError), transaction.atomic():
        insert_together([Node(id="node-a", arch="x" * 65)])
    assert not Node.objects.filter(id="node-a").exists()


# insert_rows: rows as their columns, no model instance per row; reserve_ids: keys drawn ahead of them.


def test_rows_as_columns_go_in_one_statement_with_the_defaults_filled_in(now, django_assert_num_queries):
    from inventory.models import AllocatedGPU, Allocation, Command
    from tests.factories import make_node

    make_node("node-a", now=now)
    shard = uuid.uuid4()
    with transaction.atomic():
        (alloc_id,) = reserve_ids(Allocation, 1)
        with django_assert_num_queries(1):
            insert_rows(
                [
                    (Allocation, [{"id": alloc_id, "node_id": "node-a", "replica_id": shard, "shard_id": shard}]),
                    # Rows of a later table naming the earlier one's drawn key, in the same statement.
                    (AllocatedGPU, [{"allocation_id": alloc_id, "node_id": "node-a", "gpu_index": g} for g in (3, 1)]),
                    (
                        Command,
                        [{"node_id": "node-a", "kind": "start_shard", "payload": {"n": [1]}, "created_at": now}] * 2,
                    ),
                ]
            )
    got = Allocation.objects.get(id=alloc_id)
    # Static defaults and auto_now_add filled in as save() fills them.
    assert (got.memory_gb, got.cpu_cores, got.power_w, got.shard_id) == (0, 0, 0.0, shard)
    assert got.created_at is not None
    assert sorted(got.gpus.values_list("gpu_index", flat=True)) == [1, 3]
    commands = list(Command.objects.values_list("id", "payload", "deliveries", "shard_id", "acked_at"))
    # A primary key's default is drawn for each row, not once for the call.
    assert len({c[0] for c in commands}) == 2
    assert [c[1:] for c in commands] == [({"n": [1]}, 0, "", None)] * 2


def test_a_key_that_is_no_column_is_named():
    from inventory.models import Command

    with pytest.raises(ValueError, match=r"inventory\.Command has no column 'payloads'"):
        insert_rows([(Command, [{"node_id": "node-a", "payloads": {}}])])


def test_rows_as_json_keep_what_each_column_reads_back_and_name_what_they_cannot_write():
    at = dt.datetime(2026, 12, 7, 16, 20, 1, 5, tzinfo=dt.UTC)
    key = uuid.UUID("9f86d06b-512c-4939-9aa2-0c2c64f95b56")
    assert json_rows([{"at": at, "id": key, "n": 3, "args": {"a": [1, None]}}]) == (
        '[{"at":"2026-12-07T16:20:01.000005Z","id":"9f86d06b-512c-4939-9aa2-0c2c64f95b56","n":3,"args":{"a":[1,null]}}]'
    )
    with connection.cursor() as cur:
        cur.execute("SELECT x FROM jsonb_to_recordset(%s::jsonb) AS r(x timestamptz)", [json_rows([{"x": at}])])
        assert cur.fetchone()[0] == at
    with pytest.raises(ValueError, match="cannot write a object in a row"):
        json_rows([{"x": object()}])


def test_rows_breaking_a_constraint_write_none_of_the_tables(now):
    from inventory.models import AllocatedGPU, Allocation
    from tests.factories import make_node

    make_node("node-a", now=now)
    shard = uuid.uuid4()
    with pytest.raises(IntegrityError), transaction.atomic():
        (alloc_id,) = reserve_ids(Allocation, 1)
        insert_rows(
            [
                (Allocation, [{"id": alloc_id, "node_id": "node-a", "replica_id": shard, "shard_id": shard}]),
                (AllocatedGPU, [{"allocation_id": alloc_id, "node_id": "node-a", "gpu_index": 0}] * 2),
            ]
        )
    assert not Allocation.objects.exists() and not AllocatedGPU.objects.exists()


def test_drawn_keys_are_never_drawn_again_even_when_rolled_back():
    from inventory.models import Allocation

    with pytest.raises(RuntimeError), transaction.atomic():
        first = reserve_ids(Allocation, 3)
        raise RuntimeError("roll back")
    second = reserve_ids(Allocation, 2)
    assert first == sorted(first) and len(set(first)) == 3
    assert min(second) > max(first) and second == sorted(second) and len(set(second)) == 2
    assert reserve_ids(Allocation, 0) == []
