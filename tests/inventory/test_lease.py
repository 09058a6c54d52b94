"""A lease renewal in the database: the exact statements, what they write, and what they refuse."""

from __future__ import annotations

import datetime as dt

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


def test_keep_status_renews_the_last_status_or_says_it_is_gone(settings):
    assert lease.keep_status("node-a") is False
    telemetry.put("node-a", {"at": 1.0})
    client = cache._cache.get_client()
    redis_key = cache.make_and_validate_key(telemetry.key("node-a"))
    client.expire(redis_key, 10)
    assert lease.keep_status("node-a") is True
    assert client.ttl(redis_key) > 10
    assert telemetry.get("node-a") == {"at": 1.0}
