"""The Redis cache backend: Django's, with one redis-py client per connection pool."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.cache import cache

pytestmark = pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis backend is configured only with REDIS_URL")


def test_the_redis_backend_is_llmgws():
    assert settings.CACHES["default"]["BACKEND"] == "llmgw.cache.RedisCache"


def test_one_client_per_pool_serves_every_call():
    first = cache._cache.get_client("a", write=True)
    assert cache._cache.get_client("b", write=True) is first
    assert cache._cache.get_client("c") is first  # one server: reads use the write pool


def test_values_round_trip_as_with_djangos_backend():
    cache.set("k", {"gpus": [1, 2], "at": 1.5}, timeout=30)
    cache.set("n", 7, timeout=30)
    assert cache.get("k") == {"gpus": [1, 2], "at": 1.5}
    assert cache.incr("n") == 8
    assert cache.get_many(["k", "n", "missing"]) == {"k": {"gpus": [1, 2], "at": 1.5}, "n": 8}
    cache.delete("k")
    assert cache.get("k") is None
    # Through pipelines.
    cache.set_many({"a": 1, "b": [2]}, timeout=30)
    assert cache.get_many(["a", "b"]) == {"a": 1, "b": [2]}
    cache.delete_many(["a", "b"])
    assert cache.get_many(["a", "b"]) == {}


def test_a_connection_redis_closed_is_replaced():
    import redis

    cache.set("k", 1, timeout=30)
    client = cache._cache.get_client()
    own = client.client_id()
    # As a Redis restart (or its timeout of idle clients) does.
    redis.Redis.from_url(settings.REDIS_URL).client_kill_filter(_id=own)
    assert cache.get("k") == 1
    assert client.client_id() != own


def test_incr_then_set_takes_the_next_number_and_stores_its_entry_in_one_round_trip(monkeypatch):
    cache.set("counter", 40, timeout=None)
    # The first call in a Redis that never saw the script loads it (a round trip more, once).
    assert cache.incr_then_set("counter", "entry:", [], timeout=30) == 41
    client = cache._cache.get_client(write=True)
    sent = []
    send = client.execute_command
    monkeypatch.setattr(client, "execute_command", lambda *args, **kw: sent.append(args[0]) or send(*args, **kw))
    assert cache.incr_then_set("counter", "entry:", ["node-a", "node-b"], timeout=30) == 42
    assert cache.incr_then_set("counter", "entry:", ["node-c"], timeout=30) == 43
    # Each call one round trip: the script by its hash.
    assert sent == ["EVALSHA", "EVALSHA"]
    monkeypatch.undo()
    assert cache.get("entry:42") == ["node-a", "node-b"]
    assert cache.get("entry:43") == ["node-c"]
    assert cache.get("counter") == 43
    assert 0 < client.ttl(cache.make_key("entry:42")) <= 30


def test_incr_then_set_without_the_counter_raises_and_stores_nothing():
    with pytest.raises(ValueError):
        cache.incr_then_set("absent", "entry:", ["node-a"], timeout=30)
    assert cache.get("absent") is None
    assert cache.get("entry:1") is None


def test_incr_then_set_keeps_every_digit_of_a_large_counter():
    # The change feed's versions start near 2**60: past what a double holds exactly.
    start = (1 << 60) + 1
    cache.set("counter", start, timeout=None)
    assert cache.incr_then_set("counter", "entry:", ["node-a"], timeout=30) == start + 1
    assert cache.get(f"entry:{start + 1}") == ["node-a"]


def test_touch_and_read_renews_every_key_names_those_there_and_reads_some_in_one_round_trip():
    cache.set("entry-a", {"gpus": [1]}, timeout=5)
    cache.set("digest-a", "d1", timeout=5)
    cache.delete_many(["entry-b", "digest-b"])
    client = cache._cache.get_client(None, write=True)
    sent = []
    real = client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = real(*args, **kwargs)
        execute = pipe.execute
        pipe.execute = lambda *a, **k: (sent.append(len(pipe.command_stack)), execute(*a, **k))[1]
        return pipe

    client.pipeline = counting_pipeline
    try:
        touched, values = cache.touch_and_read(["entry-a", "entry-b"], ["digest-a", "digest-b"], timeout=120)
    finally:
        del client.pipeline
    assert (touched, values) == ({"entry-a"}, {"digest-a": "d1"})
    assert sent == [4]  # one pipeline: two EXPIREs, two GETEXs
    for k in ("entry-a", "digest-a"):
        assert client.ttl(cache.make_and_validate_key(k)) > 100
    with pytest.raises(ValueError, match="number of seconds"):
        cache.touch_and_read(["entry-a"], [], timeout=None)
