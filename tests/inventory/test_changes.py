"""The change feed placement's kept index reads: versions, gaps, and what in telemetry counts as a change."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.db import transaction

from inventory import changes

pytestmark = pytest.mark.django_db


def port(state: str = "4: ACTIVE", sm: str = "0x1", **extra) -> dict:
    return {"hca": "mlx5_0", "port": 1, "state": state, "link_layer": "InfiniBand", "sm_guid": sm, **extra}


def test_marks_are_read_in_order_after_a_version():
    start = changes.current_version()
    assert start is not None
    changes.mark(["b", "a"])
    changes.mark(["c"])
    feed = changes.since(start)
    assert (feed.version, feed.node_ids, feed.gap) == (start + 2, frozenset({"a", "b", "c"}), False)
    assert feed.entries == {start + 1: frozenset({"a", "b"}), start + 2: frozenset({"c"})}
    assert changes.since(feed.version) == changes.Changes(feed.version)


def test_a_holdings_mark_reads_as_its_nodes_and_says_it_named_holdings_only():
    start = changes.current_version()
    changes.mark(["b", "a"], holdings=True)
    changes.mark(["a"])
    feed = changes.since(start)
    assert feed.node_ids == frozenset({"a", "b"})
    assert feed.entries == {start + 1: frozenset({"a", "b"}), start + 2: frozenset({"a"})}
    assert feed.holdings == frozenset({start + 1})
    # What this thread published is the nodes, without the entry's tag: the reconciler compares them.
    assert changes.published_here()[-2:] == [(start + 1, ["a", "b"]), (start + 2, ["a"])]


def test_many_marks_are_read_past_the_prefetch():
    start = changes.current_version()
    for i in range(changes.PREFETCH + 5):
        changes.mark([f"n{i}"])
    feed = changes.since(start)
    assert not feed.gap and len(feed.node_ids) == changes.PREFETCH + 5


def test_a_reader_a_join_storm_behind_reads_the_entries_not_a_gap(monkeypatch):
    # 2,500 marks behind (a storm of 1,250 registrations): read in chunks, every id, no rebuild.
    monkeypatch.setattr(changes, "FETCH_CHUNK", 1000)
    start = changes.current_version()
    for i in range(2500):
        changes.mark([f"n{i % 1200}"])
    feed = changes.since(start)
    assert (feed.gap, feed.version, len(feed.entries)) == (False, start + 2500, 2500)
    assert feed.node_ids == frozenset(f"n{i}" for i in range(1200))
    # Past MAX_BEHIND the entries would cost more than a rebuild: a gap.
    monkeypatch.setattr(changes, "MAX_BEHIND", 2000)
    assert changes.since(start).gap


def test_a_missing_entry_a_flushed_cache_or_no_version_is_a_gap():
    start = changes.current_version()
    changes.mark(["a"])
    changes.mark(["b"])
    cache.delete(changes._entry_key(start + 1))
    assert changes.since(start).gap
    cache.clear()
    changes.mark(["c"])
    # A new counter starts from a random base, never near the old one.
    assert changes.since(start).gap
    assert changes.since(None).gap


def test_every_node_reads_as_everything():
    start = changes.current_version()
    changes.mark_all()
    assert changes.since(start).everything


def test_a_mark_in_a_transaction_is_published_again_after_the_commit(django_capture_on_commit_callbacks):
    start = changes.current_version()
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        changes.mark(["a"])
        assert changes.since(start).version == start + 1
    assert changes.since(start).entries == {start + 1: frozenset({"a"}), start + 2: frozenset({"a"})}


def test_what_this_thread_published_is_told_once_and_bounded():
    changes.published_here()
    start = changes.current_version()
    changes.mark(["a"])
    assert changes.published_here() == [(start + 1, ["a"])]
    assert changes.published_here() == []
    for i in range(changes.LOG_KEPT + 10):
        changes.mark([f"n{i}"])
    assert len(changes.published_here()) == changes.LOG_KEPT


def test_telemetry_marks_only_what_placement_reads():
    before = {"ib_ports": [port()], "gpus": [{"index": 0, "power_w": 300.0, "power_limit_w": 700.0}]}
    start = changes.current_version()
    # Rates, counters and draw move every heartbeat: no mark.
    same = {
        "ib_ports": [port(counters={"port_xmit_data": 5}, tx_bps=1e9)],
        "gpus": [{"index": 0, "power_w": 650.0, "power_limit_w": 700.0}],
    }
    assert not changes.mark_telemetry("a", before, same)
    assert changes.since(start).version == start
    assert changes.mark_telemetry("a", before, {**before, "ib_ports": [port(state="1: DOWN")]})
    assert changes.mark_telemetry("a", before, {**before, "ib_ports": [port(sm="0x2")]})
    assert changes.mark_telemetry("a", before, {**before, "gpus": [{"index": 0, "power_limit_w": 500.0}]})
    assert changes.mark_telemetry("b", None, before)
    assert changes.since(start).node_ids == frozenset({"a", "b"})
