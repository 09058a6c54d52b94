"""Django's Redis cache backend, keeping one redis-py client per connection pool.

Django builds a new `redis.Redis` for every cache call. With redis-py 8 that
construction (its response-callback tables) costs more CPU than the Redis
round trip itself, which showed at the top of a heartbeat's profile. A client
over a connection pool is thread-safe, so one per pool serves every call.
Keys, serialisation and behaviour are Django's own.
"""

from __future__ import annotations

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


class RedisCache(DjangoRedisCache):
    """The cache backend named in settings.CACHES when REDIS_URL is set."""

    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = RedisCacheClient
