"""/metrics and the doctor: the last results at once, one refresh queued when stale or missing, their age exported.

A scrape never runs the checks (it would take seconds at ten thousand nodes).
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.cache import cache
from django.utils import timezone

from inventory import doctor, doctor_refresh
from inventory.doctor import kept as kept_doctor
from inventory.metrics import collect_families
from inventory.nodes import change_state
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    now = timezone.now()
    make_node("gpu-1", now=now)
    return now


@pytest.fixture
def queued(monkeypatch):
    """The refreshes a scrape asked the worker for (the test suite has no worker)."""
    asked: list[dict] = []
    monkeypatch.setattr(doctor_refresh.refresh_doctor, "apply_async", lambda **kw: asked.append(kw))
    return asked


def families(now: dt.datetime) -> dict[str, list]:
    return {f.name: f.rows for f in collect_families(now=now)}


def reachable(rows: list) -> str:
    return next(labels[1] for labels, value in rows if labels[0] == "nodes_reachable" and value == 1.0)


def test_with_nothing_kept_a_scrape_says_so_and_queues_one_refresh(node, queued, django_assert_num_queries):
    # The same statements as any scrape that serves kept results: none of the doctor's reads.
    with django_assert_num_queries(7):
        m = families(node)
    assert m["llmgw_doctor_checks"] == []
    assert m["llmgw_doctor_age_seconds"] == [((), -1.0)]
    assert queued == [{"retry": False}]
    assert cache.get(doctor_refresh.KEPT_KEY) is None
    # Another scrape before the worker ran it: not queued twice.
    families(node + dt.timedelta(seconds=1))
    assert len(queued) == 1

    assert doctor_refresh.refresh_doctor() == "pass"
    m = families(node + dt.timedelta(seconds=2))
    assert reachable(m["llmgw_doctor_checks"]) == "pass"
    assert 0.0 < m["llmgw_doctor_age_seconds"][0][1] <= 2.0


def test_the_first_scrape_after_a_start_serves_the_kept_results_with_their_age(node, queued, settings):
    settings.LLMGW_DOCTOR_CACHE = 15.0
    doctor_refresh.refresh(now=node)
    # A start: no process holds anything, the doctor's own window has lapsed; the cache still keeps the last results.
    kept_doctor.reset()
    doctor.forget_cached()
    m = families(node + dt.timedelta(hours=30))
    assert reachable(m["llmgw_doctor_checks"]) == "pass"
    assert m["llmgw_doctor_age_seconds"] == [((), 30 * 3600.0)]
    assert queued == [{"retry": False}]


def test_a_stale_scrape_serves_the_last_results_and_queues_one_refresh(
    node, queued, settings, django_assert_num_queries
):
    settings.LLMGW_DOCTOR_CACHE = 15.0
    doctor_refresh.refresh(now=node)
    change_state("gpu-1", "unreachable", now=node)
    later = node + dt.timedelta(seconds=40)
    # Nodes, GPUs, held GPUs, the liveness clock, deployments, replica counts and multi-node shards:
    # none of the doctor's reads.
    with django_assert_num_queries(7):
        m = families(later)
    assert reachable(m["llmgw_doctor_checks"]) == "pass"
    assert m["llmgw_doctor_age_seconds"] == [((), 40.0)]
    # Another web process scraping meanwhile does not queue a second one.
    families(later + dt.timedelta(seconds=1))
    assert queued == [{"retry": False}]

    assert doctor_refresh.refresh_doctor() == "warn"
    assert cache.get(doctor_refresh.QUEUED_KEY) is None
    m = families(timezone.now())
    assert reachable(m["llmgw_doctor_checks"]) == "warn"
    assert m["llmgw_doctor_age_seconds"][0][1] < 15
    # Stale again later: queued again, since the last refresh has finished.
    families(timezone.now() + dt.timedelta(seconds=60))
    assert len(queued) == 2


def test_within_the_window_the_doctors_own_run_is_used(node, queued, settings):
    settings.LLMGW_DOCTOR_CACHE = 15.0
    at, _ = doctor.latest(now=node, fresh=True)
    assert doctor_refresh.for_scrape(now=node + dt.timedelta(seconds=5))[0] == at
    assert queued == []


def test_a_broker_that_refuses_leaves_no_mark_behind(node, monkeypatch, settings):
    settings.LLMGW_DOCTOR_CACHE = 15.0
    doctor_refresh.refresh(now=node)

    def refuse(**kw):
        raise ConnectionError("broker down")

    monkeypatch.setattr(doctor_refresh.refresh_doctor, "apply_async", refuse)
    m = families(node + dt.timedelta(seconds=30))
    assert reachable(m["llmgw_doctor_checks"]) == "pass"  # the scrape is served all the same
    assert cache.get(doctor_refresh.QUEUED_KEY) is None  # and the next stale scrape asks again


def test_a_refresh_that_fails_frees_the_mark(node, monkeypatch):
    cache.add(doctor_refresh.QUEUED_KEY, True)

    def broken(**kw):
        raise RuntimeError("database gone")

    monkeypatch.setattr(kept_doctor, "refresh", broken)
    with pytest.raises(RuntimeError):
        doctor_refresh.refresh_doctor()
    assert cache.get(doctor_refresh.QUEUED_KEY) is None


def test_forget_leaves_nothing_to_serve_and_the_next_refresh_runs_in_full(node, queued, settings):
    settings.LLMGW_DOCTOR_CACHE = 15.0
    doctor_refresh.refresh(now=node)
    change_state("gpu-1", "unreachable", now=node)
    doctor_refresh.forget()
    assert families(node + dt.timedelta(seconds=30))["llmgw_doctor_age_seconds"] == [((), -1.0)]
    assert queued == [{"retry": False}]
    assert doctor_refresh.refresh_doctor() == "warn"
    # A kept doctor of its own, whose first refresh was a full run.
    assert kept_doctor.kept().full_runs == 1


def test_the_worker_knows_the_task():
    import inventory.tasks  # noqa: F401  (what the worker imports)
    from llmgw.celery import app

    assert "inventory.refresh_doctor" in app.tasks
