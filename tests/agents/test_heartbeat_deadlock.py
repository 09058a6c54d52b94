"""A heartbeat that loses a deadlock to another writer runs again: the agent sees a 200, never a 500.

A real deadlock on the real database: a writer locks the replica of the
node's shard, the heartbeat (which has renewed the node's lease) needs that
replica's key for the event of its shard's move, and the writer then
updates the node. PostgreSQL aborts the heartbeat, which waited first.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connections, transaction
from django.utils import timezone

from inventory.models import Node
from placement.models import PlacementEvent, Replica, Shard
from tests.agents.conftest import heartbeat_payload, make_shard, post
from tests.gateway.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_on_locks(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()[0]


def test_a_heartbeat_that_loses_a_deadlock_is_run_again(client, joined):
    now = timezone.now()
    shard = make_shard("node-a", now=now, state="starting")
    url = database_url()
    errors: list[BaseException] = []
    locked = threading.Event()

    def writer() -> None:
        try:
            with transaction.atomic():
                Replica.objects.select_for_update().get(id=shard.replica_id)
                locked.set()
                # Until the heartbeat waits for this replica (its commit checks the event's key): a
                # condition, however long a loaded machine takes to reach it; the bound only ends a hang.
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    if _waiting_on_locks(url):
                        break
                    threading.Event().wait(0.025)
                else:
                    raise AssertionError("the heartbeat never waited on the replica")
                # ...then the node the heartbeat holds: a cycle, which the heartbeat's wait finds first.
                Node.objects.filter(id="node-a").update(hostname="renamed-by-the-writer")
        except BaseException as exc:  # reported to the test
            errors.append(exc)
        finally:
            connections.close_all()

    t = threading.Thread(target=writer)
    t.start()
    assert locked.wait(120)
    shards = [{"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": "ready"}]
    resp = post(client, "heartbeat", heartbeat_payload(shards=shards), joined)
    t.join(150)
    assert errors == []
    assert resp.status_code == 200, resp.content
    # Both writes stand: the heartbeat's run again, after the writer's.
    assert Shard.objects.get(id=shard.id).state == "ready"
    assert PlacementEvent.objects.filter(shard_id=shard.id, to_state="ready").count() == 1
    assert Node.objects.get(id="node-a").hostname == "renamed-by-the-writer"
