"""The node credential's lookup in the heartbeat's lease renewal (one statement)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from agents import credentials
from agents.models import NodeCredential
from inventory import heartbeat as hb_rules
from inventory.models import Node, NodeState
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.test_heartbeat import _synchronous_commit

pytestmark = pytest.mark.django_db


def _credential(node_id: str, *, now: dt.datetime, token_hash: str, previous_hash: str | None = None):
    return NodeCredential.objects.create(
        node_id=node_id, token_hash=token_hash, previous_hash=previous_hash, issued_at=now, issued_by="test"
    )


@pytest.mark.e2e
def test_touch_by_credential_renews_only_its_holder_and_brings_it_back(now):
    make_node("node-a", now=now)
    make_node("node-b", now=now)
    _credential("node-a", now=now, token_hash="a" * 64, previous_hash="p" * 64)
    _credential("node-b", now=now, token_hash="b" * 64)
    change_state("node-a", NodeState.UNREACHABLE, now=now)
    later = now + dt.timedelta(seconds=30)
    found = credentials.touch_credential_holder("p" * 64, now=later)
    # PostgreSQL's statement also says whether commands wait (none here); SQLite's read leaves it unknown.
    waiting = connection.vendor != "postgresql"
    assert found == (("node-a", "a" * 64, "p" * 64, None), hb_rules.Touched("ready", "", 0, "", waiting=waiting))
    assert dict(Node.objects.values_list("id", "last_seen")) == {"node-a": later, "node-b": now}
    assert Node.objects.get(id="node-a").state == NodeState.READY
    assert credentials.touch_credential_holder("c" * 64, now=later) is None


@pytest.mark.django_db(transaction=True)
def test_touch_by_credential_commits_asynchronously_when_asked(now):
    from django.db import transaction

    make_node("node-a", now=now)
    _credential("node-a", now=now, token_hash="a" * 64)
    with transaction.atomic():
        assert credentials.touch_credential_holder("a" * 64, now=now, durable=False) is not None
        assert _synchronous_commit() == "off"
    assert _synchronous_commit() == "on"
    with transaction.atomic():
        credentials.touch_credential_holder("a" * 64, now=now)
        assert _synchronous_commit() == "on"
