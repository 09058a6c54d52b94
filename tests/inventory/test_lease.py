"""A lease renewal in the database: the exact statements, what they write, and what they refuse."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext

import llmgw_wire as wire
from agents import credentials
from agents.models import NodeCredential
from inventory import lease, outbox, telemetry
from inventory.models import Command, Node
from tests.factories import make_node
from tests.gateway.conftest import database_url

pytestmark = pytest.mark.django_db

TABLES = lease.Tables(credentials=NodeCredential._meta.db_table, commands=Command._meta.db_table)

RENEWAL = (
    "UPDATE inventory_node AS n SET last_seen = %(now)s, unreachable_since = NULL "
    "FROM agents_nodecredential AS c, (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit "
    "WHERE c.node_id = %(node)s AND (c.token_hash = %(hash)s OR c.previous_hash = %(hash)s) AND n.id = c.node_id "
    "RETURNING c.token_hash, c.previous_hash, c.rotation_requested_at, n.state, "
    "EXISTS (SELECT 1 FROM agents_command AS m WHERE m.node_id = n.id AND m.acked_at IS NULL)"
)
RENEWAL_WITH_ACKS = (
    "WITH acked AS (UPDATE agents_command SET acked_at = %(now)s "
    "WHERE node_id = %(node)s AND id = ANY(%(acks)s) AND acked_at IS NULL "
    "AND EXISTS (SELECT 1 FROM agents_nodecredential AS c "
    "WHERE c.node_id = %(node)s AND (c.token_hash = %(hash)s OR c.previous_hash = %(hash)s)) RETURNING id) "
    "UPDATE inventory_node AS n SET last_seen = %(now)s, unreachable_since = NULL "
    "FROM agents_nodecredential AS c, (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit "
    "WHERE c.node_id = %(node)s AND (c.token_hash = %(hash)s OR c.previous_hash = %(hash)s) AND n.id = c.node_id "
    "RETURNING c.token_hash, c.previous_hash, c.rotation_requested_at, n.state, "
    "EXISTS (SELECT 1 FROM agents_command AS m WHERE m.node_id = n.id AND m.acked_at IS NULL "
    "AND NOT (m.id = ANY(%(acks)s)))"
)
TAKE = (
    "WITH w AS (SELECT id, created_at FROM agents_command WHERE node_id = %(node)s AND acked_at IS NULL "
    "ORDER BY created_at, id LIMIT %(more)s), "
    "u AS (UPDATE agents_command AS m SET deliveries = m.deliveries + 1, "
    "first_delivered_at = COALESCE(m.first_delivered_at, %(now)s) "
    "FROM (SELECT id FROM w ORDER BY created_at, id LIMIT %(limit)s) AS s WHERE m.id = s.id "
    "RETURNING m.id, m.kind, m.payload, m.created_at) "
    "SELECT id, kind, payload, (SELECT count(*) FROM w) FROM u ORDER BY created_at, id"
)


BATCH_TAIL = (
    "v AS (SELECT * FROM unnest(%(nodes)s::varchar[], %(hashes)s::varchar[]) AS v(node_id, h)), "
    "free AS (SELECT f.id FROM inventory_node AS f WHERE f.id = ANY(%(nodes)s::varchar[]) "
    "ORDER BY f.id FOR NO KEY UPDATE SKIP LOCKED), "
    "renewed AS (UPDATE inventory_node AS n SET last_seen = %(now)s, unreachable_since = NULL "
    "FROM v JOIN agents_nodecredential AS c ON c.node_id = v.node_id "
    "AND (c.token_hash = v.h OR c.previous_hash = v.h), "
    "(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit "
    "WHERE n.id = v.node_id AND n.id IN (SELECT id FROM free) "
    "RETURNING n.id, c.token_hash, c.previous_hash, c.rotation_requested_at, n.state, "
    "EXISTS (SELECT 1 FROM agents_command AS m WHERE m.node_id = n.id AND m.acked_at IS NULL{not_acked}) AS waiting) "
    "SELECT true, r.* FROM renewed AS r UNION ALL "
    "SELECT false, v.node_id, NULL::varchar, NULL::varchar, NULL::timestamptz, NULL::varchar, NULL::boolean "
    "FROM v WHERE NOT EXISTS (SELECT 1 FROM free WHERE free.id = v.node_id) "
    "AND EXISTS (SELECT 1 FROM inventory_node AS x WHERE x.id = v.node_id)"
)
BATCH = "WITH " + BATCH_TAIL.format(not_acked="")
BATCH_ACKS = (
    "WITH acked AS (UPDATE agents_command AS m SET acked_at = %(now)s "
    "FROM unnest(%(ack_nodes)s::varchar[], %(ack_hashes)s::varchar[], %(ack_ids)s::uuid[]) AS a(node_id, h, id) "
    "JOIN agents_nodecredential AS ac ON ac.node_id = a.node_id AND (ac.token_hash = a.h OR ac.previous_hash = a.h) "
    "WHERE m.id = a.id AND m.node_id = a.node_id AND m.acked_at IS NULL RETURNING m.id), "
) + BATCH_TAIL.format(not_acked=" AND NOT EXISTS (SELECT 1 FROM acked WHERE acked.id = m.id)")


@pytest.fixture
def node_a(now) -> str:
    """node-a with a credential; returns the credential's hash."""
    make_node("node-a", now=now)
    secret = credentials.issue("node-a", now=now, issued_by="test")
    return credentials.hash_secret(secret)


def sent(q: CaptureQueriesContext) -> list[str]:
    return [x["sql"] for x in q.captured_queries]


def test_the_statements_are_pinned():
    assert lease.renewal_sql(TABLES, acks=False, relax=True) == RENEWAL
    assert lease.renewal_sql(TABLES, acks=True, relax=True) == RENEWAL_WITH_ACKS
    assert "set_config" not in lease.renewal_sql(TABLES, acks=False, relax=False)
    assert lease.take_sql(TABLES) == TAKE


def test_a_renewal_is_one_statement_and_renews_the_lease(node_a, now):
    Node.objects.filter(id="node-a").update(last_seen=now - dt.timedelta(minutes=5))
    with CaptureQueriesContext(connection) as q:
        got = lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now)
    assert len(q.captured_queries) == 1
    assert sent(q)[0].startswith("UPDATE inventory_node AS n SET last_seen = ")
    assert got == lease.Renewal(
        node_id="node-a",
        token_hash=node_a,
        previous_hash=None,
        rotation_requested_at=None,
        state="ready",
        waiting=False,
    )
    assert Node.objects.get(id="node-a").last_seen == now


def test_a_credential_renews_only_its_own_node(node_a, now):
    make_node("node-b", now=now)
    theirs = credentials.hash_secret(credentials.issue("node-b", now=now, issued_by="test"))
    old = now - dt.timedelta(minutes=5)
    Node.objects.update(last_seen=old)
    for node_id, token_hash in (("node-b", node_a), ("node-a", theirs), ("node-a", "0" * 64), ("node-zzz", node_a)):
        assert lease.renew(TABLES, node_id=node_id, token_hash=token_hash, now=now) is None
    assert set(Node.objects.values_list("last_seen", flat=True)) == {old}


def test_the_previous_secret_of_a_rotation_still_renews(node_a, now):
    new = credentials.rotate("node-a", now=now)
    got = lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now)
    assert got is not None and got.previous_hash == node_a
    assert got.token_hash == credentials.hash_secret(new)


def test_waiting_commands_are_seen_and_acks_taken_in_the_same_statement(node_a, now):
    a = outbox.enqueue("node-a", wire.InstallEngine(engine="a"), now=now)
    assert lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now).waiting is True
    with CaptureQueriesContext(connection) as q:
        got = lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now, acks=[str(a.id), "junk"])
    assert len(q.captured_queries) == 1
    assert got.waiting is False
    assert Command.objects.get(id=a.id).acked_at == now


def test_acks_under_a_refused_credential_are_not_taken(node_a, now):
    a = outbox.enqueue("node-a", wire.InstallEngine(engine="a"), now=now)
    assert lease.renew(TABLES, node_id="node-a", token_hash="f" * 64, now=now, acks=[str(a.id)]) is None
    assert Command.objects.get(id=a.id).acked_at is None


TAKE_BATCH = (
    "WITH r AS (SELECT id, node_id, created_at, "
    "row_number() OVER (PARTITION BY node_id ORDER BY created_at, id) AS k "
    "FROM agents_command WHERE node_id = ANY(%(nodes)s::varchar[]) AND acked_at IS NULL), "
    "w AS (SELECT id, node_id, k FROM r WHERE k <= %(more)s), "
    "u AS (UPDATE agents_command AS m SET deliveries = m.deliveries + 1, "
    "first_delivered_at = COALESCE(m.first_delivered_at, %(now)s) "
    "FROM w WHERE m.id = w.id AND w.k <= %(limit)s RETURNING m.node_id, m.id, m.kind, m.payload, w.k) "
    "SELECT u.node_id, u.id, u.kind, u.payload, (SELECT max(x.k) FROM w AS x WHERE x.node_id = u.node_id) "
    "FROM u ORDER BY u.node_id, u.k"
)


def test_take_waiting_batch_is_one_statement_for_every_node_each_oldest_first(node_a, now):
    assert lease.take_batch_sql(TABLES) == TAKE_BATCH
    for n in ("node-b", "node-c", "node-d"):
        make_node(n, now=now)
    made = {
        n: [
            outbox.enqueue(n, wire.InstallEngine(engine=f"{n}/{i}"), now=now + dt.timedelta(seconds=i))
            for i in range(k)
        ]
        for n, k in (("node-a", 5), ("node-b", 3), ("node-c", 1))
    }
    acked = made["node-c"][0]
    Command.objects.filter(id=acked.id).update(acked_at=now)
    with CaptureQueriesContext(connection) as q:
        got = lease.take_waiting_batch(TABLES, ["node-b", "node-a", "node-c", "node-d"], now=now, limit=3)
    assert len(q.captured_queries) == 1
    # Each node's oldest three, and whether more wait (exactly three waiting is not "more").
    assert {n: ([r[0] for r in rows], more) for n, (rows, more) in got.items()} == {
        "node-a": ([m.id for m in made["node-a"][:3]], True),
        "node-b": ([m.id for m in made["node-b"]], False),
    }
    assert [r[2]["engine"] for r in got["node-b"][0]] == ["node-b/0", "node-b/1", "node-b/2"]
    deliveries = dict(Command.objects.values_list("payload__engine", "deliveries"))
    assert deliveries == {"node-a/0": 1, "node-a/1": 1, "node-a/2": 1, "node-a/3": 0, "node-a/4": 0,
                          "node-b/0": 1, "node-b/1": 1, "node-b/2": 1, "node-c/0": 0}  # fmt: skip
    assert lease.take_waiting_batch(TABLES, [], now=now, limit=3) == {}


def test_take_waiting_is_one_statement_oldest_first(node_a, now):
    made = [
        outbox.enqueue("node-a", wire.InstallEngine(engine=f"e{i}"), now=now + dt.timedelta(seconds=i))
        for i in range(5)
    ]
    with CaptureQueriesContext(connection) as q:
        rows, more = lease.take_waiting(TABLES, "node-a", now=now, limit=3)
    assert len(q.captured_queries) == 1
    assert [r[0] for r in rows] == [m.id for m in made[:3]]
    assert [r[2]["engine"] for r in rows] == ["e0", "e1", "e2"]
    assert more is True
    assert list(Command.objects.order_by("created_at").values_list("deliveries", flat=True)) == [1, 1, 1, 0, 0]
    rows, more = lease.take_waiting(TABLES, "node-a", now=now, limit=5)
    assert (len(rows), more) == (5, False)


def test_an_unreachable_node_comes_back(node_a, now):
    Node.objects.filter(id="node-a").update(state="unreachable", unreachable_since=now)
    assert lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now).state == "ready"
    node = Node.objects.get(id="node-a")
    assert (node.state, node.unreachable_since) == ("ready", None)


def test_the_portable_path_does_the_same(node_a, now, monkeypatch):
    # What SQLite (the embedded default) runs: the same answers, a statement at a time.
    a = outbox.enqueue("node-a", wire.InstallEngine(engine="a"), now=now)
    b = outbox.enqueue("node-a", wire.InstallEngine(engine="b"), now=now + dt.timedelta(seconds=1))
    monkeypatch.setattr(connection, "vendor", "sqlite")
    assert lease.renew(TABLES, node_id="node-a", token_hash="0" * 64, now=now) is None
    got = lease.renew(TABLES, node_id="node-a", token_hash=node_a, now=now, acks=[str(a.id)])
    assert (got.state, got.waiting) == ("ready", True)
    rows, more = lease.take_waiting(TABLES, "node-a", now=now, limit=1)
    assert ([r[0] for r in rows], more) == ([b.id], False)
    assert Command.objects.get(id=a.id).acked_at == now and Command.objects.get(id=b.id).deliveries == 1


# --- batches (agents/lease_asgi.py) ------------------------------------------------


@pytest.fixture
def fleet(now) -> dict[str, str]:
    """node-0 .. node-4, each with a credential; their hashes by node."""
    out = {}
    for i in range(5):
        make_node(f"node-{i}", now=now)
        out[f"node-{i}"] = credentials.hash_secret(credentials.issue(f"node-{i}", now=now, issued_by="test"))
    return out


def test_the_batch_statement_is_pinned():
    assert lease.batch_sql(TABLES, acks=False, relax=True) == BATCH
    assert lease.batch_sql(TABLES, acks=True, relax=True) == BATCH_ACKS
    assert "set_config" not in lease.batch_sql(TABLES, acks=False, relax=False)


def test_a_batch_is_one_statement_whatever_its_size(fleet, now):
    old = now - dt.timedelta(minutes=5)
    Node.objects.update(last_seen=old)
    for size in (1, 3, 5):
        asks = [lease.Ask(node_id=n, token_hash=h) for n, h in list(fleet.items())[:size]]
        at = now + dt.timedelta(seconds=size)
        with CaptureQueriesContext(connection) as q:
            got = lease.renew_batch(TABLES, asks, now=at)
        # As sent (server-side binding numbers the parameters).
        assert len(q.captured_queries) == 1, size
        assert sent(q)[0].startswith("WITH v AS (SELECT * FROM unnest($1::varchar[], $2::varchar[]) AS v(node_id, h))")
        assert sorted(got) == sorted(a.node_id for a in asks)
        assert got[asks[0].node_id] == lease.Renewal(
            node_id=asks[0].node_id,
            token_hash=asks[0].token_hash,
            previous_hash=None,
            rotation_requested_at=None,
            state="ready",
            waiting=False,
        )
        assert Node.objects.filter(last_seen=at).count() == size


def test_a_batch_with_acks_is_still_one_statement(fleet, now):
    a = outbox.enqueue("node-0", wire.InstallEngine(engine="a"), now=now)
    b = outbox.enqueue("node-1", wire.InstallEngine(engine="b"), now=now)
    c = outbox.enqueue("node-1", wire.InstallEngine(engine="c"), now=now)
    asks = [
        lease.Ask(node_id="node-0", token_hash=fleet["node-0"], acks=[str(a.id), "junk"]),
        lease.Ask(node_id="node-1", token_hash=fleet["node-1"], acks=[str(b.id)]),
        lease.Ask(node_id="node-2", token_hash=fleet["node-2"]),
    ]
    with CaptureQueriesContext(connection) as q:
        got = lease.renew_batch(TABLES, asks, now=now)
    assert len(q.captured_queries) == 1
    assert {n: r.waiting for n, r in got.items()} == {"node-0": False, "node-1": True, "node-2": False}
    assert Command.objects.get(id=a.id).acked_at == now
    assert Command.objects.get(id=b.id).acked_at == now
    assert Command.objects.get(id=c.id).acked_at is None


def test_a_batch_renews_only_the_leases_whose_credential_is_their_nodes(fleet, now):
    theirs = outbox.enqueue("node-0", wire.InstallEngine(engine="a"), now=now)
    old = now - dt.timedelta(minutes=5)
    Node.objects.update(last_seen=old)
    asks = [
        # node-1's credential on node-0's lease, acknowledging node-0's command.
        lease.Ask(node_id="node-0", token_hash=fleet["node-1"], acks=[str(theirs.id)]),
        lease.Ask(node_id="node-2", token_hash="0" * 64),
        lease.Ask(node_id="node-zzz", token_hash=fleet["node-3"]),
        lease.Ask(node_id="node-4", token_hash=fleet["node-4"]),
    ]
    got = lease.renew_batch(TABLES, asks, now=now)
    assert list(got) == ["node-4"]
    assert dict(Node.objects.values_list("id", "last_seen")) == {
        "node-0": old,
        "node-1": old,
        "node-2": old,
        "node-3": old,
        "node-4": now,
    }
    assert Command.objects.get(id=theirs.id).acked_at is None


def test_a_batch_brings_unreachable_and_lost_nodes_back(fleet, now):
    Node.objects.filter(id="node-0").update(state="unreachable", unreachable_since=now)
    Node.objects.filter(id="node-1").update(state="lost", unreachable_since=now)
    got = lease.renew_batch(TABLES, [lease.Ask(node_id=n, token_hash=fleet[n]) for n in ("node-0", "node-1")], now=now)
    assert {n: r.state for n, r in got.items()} == {"node-0": "ready", "node-1": "ready"}
    assert set(Node.objects.filter(id__in=["node-0", "node-1"]).values_list("state", "unreachable_since")) == {
        ("ready", None)
    }


def test_a_batch_names_each_node_once(fleet, now):
    with pytest.raises(ValueError, match="at most one lease per node"):
        lease.renew_batch(TABLES, [lease.Ask(node_id="node-0", token_hash=fleet["node-0"])] * 2, now=now)
    assert lease.renew_batch(TABLES, [], now=now) == {}


def test_the_portable_path_renews_a_batch_too(fleet, now, monkeypatch):
    a = outbox.enqueue("node-0", wire.InstallEngine(engine="a"), now=now)
    monkeypatch.setattr(connection, "vendor", "sqlite")
    asks = [
        lease.Ask(node_id="node-0", token_hash=fleet["node-0"], acks=[str(a.id)]),
        lease.Ask(node_id="node-1", token_hash=fleet["node-2"]),
    ]
    got = lease.renew_batch(TABLES, asks, now=now)
    assert {n: r.waiting for n, r in got.items()} == {"node-0": False}
    assert Command.objects.get(id=a.id).acked_at == now


def test_keep_status_renews_the_last_status_or_says_it_is_gone(settings):
    assert lease.keep_status("node-a") is False
    telemetry.put("node-a", {"at": 1.0})
    client = cache._cache.get_client()
    redis_key = cache.make_and_validate_key(telemetry.key("node-a"))
    client.expire(redis_key, 10)
    assert lease.keep_status("node-a") is True
    assert client.ttl(redis_key) > 10
    assert telemetry.get("node-a") == {"at": 1.0}


def test_keep_statuses_renews_many_in_one_round_trip_and_names_those_gone(settings):
    telemetry.forget("node-b")
    for n in ("node-a", "node-c"):
        telemetry.put(n, {"at": 1.0})
    client = cache._cache.get_client()
    keys = {n: cache.make_and_validate_key(telemetry.key(n)) for n in ("node-a", "node-c")}
    for k in keys.values():
        client.expire(k, 10)
    assert lease.keep_statuses(["node-a", "node-b", "node-c"]) == {"node-b"}
    assert all(client.ttl(k) > 10 for k in keys.values())
    assert lease.keep_statuses([]) == set()


@pytest.mark.django_db(transaction=True)
def test_a_batch_skips_a_node_whose_row_another_transaction_holds(fleet, now):
    # One busy row (the node's own full heartbeat, an operator's change) must not hold the whole
    # batch: the others are renewed at once, the busy one renews nothing and is named for the next.
    before = Node.objects.get(id="node-1").last_seen
    at = now + dt.timedelta(seconds=5)
    asks = [lease.Ask(node_id=n, token_hash=fleet[n]) for n in ("node-0", "node-1", "node-2")]
    with psycopg.connect(database_url()) as holder:
        holder.execute("SELECT id FROM inventory_node WHERE id = 'node-1' FOR UPDATE")
        busy: set[str] = set()
        got = lease.renew_batch(TABLES, asks, now=at, busy=busy)
        assert sorted(got) == ["node-0", "node-2"]
        assert busy == {"node-1"}
        holder.rollback()
    assert dict(Node.objects.filter(id__in=["node-0", "node-1", "node-2"]).values_list("id", "last_seen")) == {
        "node-0": at,
        "node-1": before,
        "node-2": at,
    }
    # Free again: the next batch renews it.
    busy = set()
    assert sorted(lease.renew_batch(TABLES, asks[1:2], now=at, busy=busy)) == ["node-1"]
    assert busy == set()
    assert Node.objects.get(id="node-1").last_seen == at


@pytest.mark.django_db(transaction=True)
def test_a_node_that_does_not_exist_is_neither_renewed_nor_busy(fleet, now):
    busy: set[str] = set()
    got = lease.renew_batch(TABLES, [lease.Ask(node_id="node-9", token_hash=fleet["node-0"])], now=now, busy=busy)
    assert got == {}
    assert busy == set()


def test_a_renewal_is_a_heap_only_update(fleet, now):
    # With an index on last_seen, each renewal was a new row version in all of the node table's seven
    # indexes, at twice the database's CPU a lease. None covers what a lease writes, and the table's
    # pages keep room for the new version beside the old one.
    if connection.vendor != "postgresql":
        pytest.skip("heap-only updates are PostgreSQL's")
    with connection.cursor() as c:
        c.execute(
            "SELECT a.attname FROM pg_index AS i JOIN pg_attribute AS a "
            "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indrelid = 'inventory_node'::regclass"
        )
        indexed = {r[0] for r in c.fetchall()}
        c.execute("SELECT reloptions FROM pg_class WHERE oid = 'inventory_node'::regclass")
        options = c.fetchone()[0]
    assert "last_seen" not in indexed and "unreachable_since" not in indexed
    assert "state" in indexed
    assert options == ["fillfactor=70"]

    def updates() -> tuple[int, int]:
        # This transaction's own counts, seen at once (the cumulative view waits for a flush).
        with connection.cursor() as c:
            c.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relid = 'inventory_node'::regclass"
            )
            return c.fetchone()

    before = updates()
    got = lease.renew_batch(TABLES, [lease.Ask(node_id="node-3", token_hash=fleet["node-3"])], now=now)
    after = updates()
    assert sorted(got) == ["node-3"]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_confirm_statuses_names_the_floors_whose_status_is_not_the_one_held_and_renews_the_others():
    telemetry.forget("node-b")
    telemetry.put("node-a", {"at": 1.0}, digest="da")
    telemetry.put("node-c", {"at": 1.0}, digest="dc")
    telemetry.put("node-d", {"at": 1.0})  # an entry with no digest beside it (rewritten, or an older server's)
    cache.delete(telemetry.digest_key("node-d"))
    client = cache._cache.get_client()
    for n in ("node-a", "node-c"):
        for k in (telemetry.key(n), telemetry.digest_key(n)):
            client.expire(cache.make_and_validate_key(k), 10)
    floors = {"node-a": "da", "node-b": "db", "node-c": "another", "node-d": "dd"}
    assert lease.confirm_statuses(floors) == {"node-b", "node-c", "node-d"}
    for k in (telemetry.key("node-a"), telemetry.digest_key("node-a")):
        assert client.ttl(cache.make_and_validate_key(k)) > 10
    assert telemetry.get("node-a") == {"at": 1.0}
    assert lease.confirm_statuses({}) == set()


def test_put_without_a_digest_leaves_the_digest_and_forget_drops_both():
    telemetry.put("node-a", {"at": 1.0}, digest="da")
    telemetry.put("node-a", {"at": 1.0, "applied": {}})
    assert cache.get(telemetry.digest_key("node-a")) == "da"
    telemetry.forget("node-a")
    assert (telemetry.get("node-a"), cache.get(telemetry.digest_key("node-a"))) == (None, None)
