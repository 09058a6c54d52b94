"""Django's Redis cache backend, keeping one redis-py client per connection pool.

Django builds a new `redis.Redis` for every cache call. With redis-py 8 that
construction (its response-callback tables) costs more CPU than the Redis
round trip itself, which showed at the top of a heartbeat's profile. A client
over a connection pool is thread-safe, so one per pool serves every call.
Keys, serialisation and behaviour are Django's own.

It adds two operations, each one round trip where Django's calls would take
several: `incr_then_set`, a counter's next value and an entry named after it
(the placement feed's mark, inventory/changes.py), and `touch_and_read`, the
lifetimes of many entries renewed and some of them read (a batch of leases'
status floors, inventory/lease.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.redis import RedisCache as DjangoRedisCache
from django.core.cache.backends.redis import RedisCacheClient as DjangoRedisCacheClient


class RedisCacheClient(DjangoRedisCacheClient):
    """Django's client, reusing one redis-py client per pool."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._clients: dict = {}

    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)
        client = self._clients.get(pool)
        if client is None:
            client = self._clients[pool] = self._client(connection_pool=pool)
        return client


# KEYS[1] the counter; ARGV the entry's key less the number, its value, its lifetime in seconds.
# Nothing when there is no counter (as Django's incr raises ValueError then). The number is read
# back as text: Lua's numbers are doubles, which would round the feed's (2**60 and more).
INCR_THEN_SET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('INCR', KEYS[1])
local v = redis.call('GET', KEYS[1])
redis.call('SET', ARGV[1] .. v, ARGV[2], 'EX', ARGV[3])
return v
"""


class RedisCache(DjangoRedisCache):
    """The cache backend named in settings.CACHES when REDIS_URL is set."""

    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = RedisCacheClient
        self._scripts: dict = {}

    def incr_then_set(self, counter: str, entry_prefix: str, value: Any, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Add one to `counter` and store `value` under `entry_prefix` + the new number for `timeout` seconds.

        Atomically, in one round trip. Raises ValueError when the counter is
        absent, as incr does; then nothing is stored.
        """
        key = self.make_and_validate_key(counter)
        prefix = self.make_and_validate_key(entry_prefix)
        seconds = self.get_backend_timeout(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError("incr_then_set stores an entry for a number of seconds")
        client = self._cache.get_client(key, write=True)
        script = self._scripts.get(client)
        if script is None:
            script = self._scripts[client] = client.register_script(INCR_THEN_SET)
        # Django's keys are "<prefix>:<version>:<key>", so the entry's is the prefix's key and the number.
        found = script(keys=[key], args=[prefix, self._cache._serializer.dumps(value), int(seconds)])
        if found is None:
            raise ValueError(f"Key '{counter}' not found.")
        return int(found)

    def touch_and_read(
        self, touch: Sequence[str], read: Sequence[str], timeout: float = DEFAULT_TIMEOUT
    ) -> tuple[set[str], dict[str, Any]]:
        """Give every key of `touch` and `read` `timeout` more seconds; which of `touch` exist, and `read`'s values.

        One pipelined round trip (EXPIRE for each of `touch`, GETEX for each
        of `read`). A key absent from the values was not there.
        """
        seconds = self.get_backend_timeout(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError("touch_and_read renews entries for a number of seconds")
        client = self._cache.get_client(None, write=True)
        pipe = client.pipeline(transaction=False)
        for k in touch:
            pipe.expire(self.make_and_validate_key(k), int(seconds))
        for k in read:
            pipe.getex(self.make_and_validate_key(k), ex=int(seconds))
        found = pipe.execute()
        touched = {k for k, ok in zip(touch, found[: len(touch)], strict=True) if ok}
        loads = self._cache._serializer.loads
        values = {k: loads(v) for k, v in zip(read, found[len(touch) :], strict=True) if v is not None}
        return touched, values
