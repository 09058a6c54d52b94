"""Publishing a node's wakeup: after the commit, on the node's own channel, never raising."""

from __future__ import annotations

import time

import pytest
import redis
from django.db import transaction

from inventory import wakeups


@pytest.fixture
def listener(settings):
    """A real Redis subscription to every node's wakeup channel."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub()
    pubsub.psubscribe(wakeups.channel_prefix() + "*")
    assert pubsub.get_message(timeout=2)["type"] == "psubscribe"
    yield pubsub
    pubsub.close()
    client.close()


def heard(pubsub, timeout: float = 2.0) -> list[str]:
    """The channels published within `timeout` seconds (stops at the first quiet 0.2 s after one)."""
    got: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = pubsub.get_message(timeout=0.2)
        if m is None:
            if got:
                break
            continue
        if m["type"] == "pmessage":
            got.append(m["channel"].decode())
    return got


def test_channel_is_per_node_under_the_install_prefix(settings):
    settings.LLMGW_CACHE_PREFIX = "site-a"
    assert wakeups.channel("gpu-01") == "site-a:agent-wakeup:gpu-01"
    assert wakeups.channel("gpu-01") != wakeups.channel("gpu-02")


def test_publish_reaches_the_subscriber_of_that_node(listener):
    assert wakeups.publish("gpu-01") == 1
    assert heard(listener) == [wakeups.channel("gpu-01")]


@pytest.mark.django_db(transaction=True)
def test_published_only_once_the_transaction_commits(listener):
    with transaction.atomic():
        wakeups.publish_on_commit("gpu-07")
        # Not before the commit: an agent woken now would find no command yet.
        assert heard(listener, timeout=0.5) == []
    assert heard(listener) == [wakeups.channel("gpu-07")]


@pytest.mark.django_db(transaction=True)
def test_nothing_is_published_when_the_transaction_rolls_back(listener):
    with pytest.raises(RuntimeError), transaction.atomic():
        wakeups.publish_on_commit("gpu-08")
        raise RuntimeError("placement conflict")
    assert heard(listener, timeout=0.5) == []


def test_without_redis_the_wakeup_is_off(settings, monkeypatch):
    settings.REDIS_URL = ""
    monkeypatch.setattr(wakeups, "_client", None)
    assert wakeups.publish("gpu-01") == 0
    wakeups.publish_on_commit("gpu-01")  # no transaction, no Redis: nothing to do, no error


def test_a_redis_outage_is_logged_not_raised(settings, monkeypatch, caplog):
    monkeypatch.setattr(wakeups, "_client", redis.Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.2))
    assert wakeups.publish("gpu-01") == 0
    assert "could not publish" in caplog.text
