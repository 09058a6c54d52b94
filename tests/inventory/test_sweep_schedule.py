"""The next liveness sweep is scheduled for the next deadline, one waiting at a time."""

from __future__ import annotations

import datetime as dt

import pytest

from inventory import sweep_schedule
from inventory.models import Node, NodeState
from inventory.tasks import liveness_sweep
from tests.factories import make_node

T0 = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.UTC)


def s(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def due(ready=(), unreachable=(), now=T0):
    return sweep_schedule.next_due(
        now, ready_last_seen=ready, unreachable_last_seen=unreachable, unreachable_after=30, lost_after=300
    )


def test_next_due_is_the_first_deadline_ahead():
    # Heard 10 s and 25 s ago: the second crosses 30 s in 5 s (plus the slack).
    assert due(ready=[s(-10), s(-25)]) == s(5.5)
    # Unreachable since a heartbeat 290 s ago: lost in 10.5 s, before a ready one's 20.5 s.
    assert due(ready=[s(-10)], unreachable=[s(-290)]) == s(10.5)
    assert due(ready=[None], unreachable=[None, s(-100)]) == s(200.5)


def test_deadlines_already_past_are_the_ticks_business():
    # A node left unjudged (blind window, lost budget) would otherwise sweep in a loop.
    assert due(ready=[s(-31)], unreachable=[s(-400)]) is None
    assert due(ready=[s(-30.5)]) is None
    assert due(ready=[s(-30.4)]) == s(0.1)
    assert due() is None


def test_should_schedule_when_none_waits_or_earlier():
    ok = sweep_schedule.should_schedule
    assert ok(s(5), None, now=T0, horizon_s=10)
    assert ok(s(5), s(8), now=T0, horizon_s=10)
    assert not ok(s(8), s(5), now=T0, horizon_s=10)
    assert not ok(s(5), s(5), now=T0, horizon_s=10)
    # Beyond beat's tick: the tick's sweep schedules it, closer.
    assert not ok(s(10.5), None, now=T0, horizon_s=10)
    assert not ok(None, None, now=T0, horizon_s=10)


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(sweep_schedule.app, "send_task", lambda name, **kw: calls.append((name, kw)))
    return calls


def seen(node_id: str, at: dt.datetime, state: str = NodeState.READY) -> None:
    Node.objects.filter(id=node_id).update(last_seen=at, state=state)


@pytest.mark.django_db
def test_schedule_next_queues_one_sweep_at_the_deadline(sent, settings):
    settings.LLMGW_UNREACHABLE_AFTER, settings.LLMGW_LOST_AFTER, settings.LLMGW_LIVENESS_INTERVAL = 30, 300, 10
    for n in ("node-a", "node-b", "node-c"):
        make_node(n, now=T0)
    seen("node-a", s(-26))
    seen("node-b", s(-5))
    seen("node-c", s(-40), NodeState.UNREACHABLE)  # lost at 260.5 s: far off
    assert sweep_schedule.oldest_deadlines(T0) == (s(-26), s(-40))
    assert sweep_schedule.schedule_next(now=T0) == s(4.5)
    assert sent == [
        ("agents.liveness_sweep", {"kwargs": {"due": s(4.5).isoformat()}, "eta": s(4.5), "expires": s(14.5)})
    ]
    # A second sweep a moment later finds the same deadline waiting: nothing more.
    assert sweep_schedule.schedule_next(now=s(1)) is None
    # A node that went unreachable earlier moves the deadline earlier: replaced.
    seen("node-c", s(-298), NodeState.UNREACHABLE)
    assert sweep_schedule.schedule_next(now=s(1)) == s(2.5)
    assert [kw["eta"] for _, kw in sent] == [s(4.5), s(2.5)]


@pytest.mark.django_db
def test_only_the_sweep_holding_the_slot_frees_it(sent, settings):
    settings.LLMGW_UNREACHABLE_AFTER, settings.LLMGW_LIVENESS_INTERVAL = 30, 10
    make_node("node-a", now=T0)
    seen("node-a", s(-26))
    first = sweep_schedule.schedule_next(now=T0)
    sweep_schedule.sweep_started(s(99).isoformat())  # a replaced, later one
    assert sweep_schedule.schedule_next(now=T0) is None
    sweep_schedule.sweep_started(first.isoformat())
    assert sweep_schedule.schedule_next(now=T0) == first
    assert len(sent) == 2


@pytest.mark.django_db
def test_the_sweep_task_schedules_its_successor(sent, settings):
    settings.LLMGW_UNREACHABLE_AFTER, settings.LLMGW_LIVENESS_INTERVAL = 30, 10
    make_node("node-a", now=T0)
    # Heard 25 s before the task's clock: due within the tick.
    Node.objects.update(last_seen=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=25))
    liveness_sweep()
    assert len(sent) == 1
    name, kw = sent[0]
    assert name == "agents.liveness_sweep"
    wait = (kw["eta"] - dt.datetime.now(dt.UTC)).total_seconds()
    assert 0 < wait <= 5.5
    assert kw["kwargs"] == {"due": kw["eta"].isoformat()}
