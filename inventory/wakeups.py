"""Wake an agent the moment work is queued for it: a message on its node's Redis channel.

Commands used to wait for the node's next heartbeat (every few seconds), so
a replica was ready 8-10 s after the deployment's POST though placement took
under a second. Each agent now holds a long-poll open (agents/wakeup.py,
served by an ASGI process); enqueuing a command publishes the node's channel
once the transaction commits, the long-poll answers, and the agent
heartbeats at once to fetch the command.

A message only says "come and look": the command itself is in the database
and reaches the agent with its heartbeat, as before. A lost message costs
one heartbeat interval, never a command. Without Redis (the embedded
default) nothing is published and agents keep to their interval.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

_client: redis.Redis | None = None


def channel_prefix() -> str:
    """Every node's channel starts with this (the install's cache prefix keeps installs sharing a Redis apart)."""
    return f"{settings.LLMGW_CACHE_PREFIX}:agent-wakeup:"


def channel(node_id: str) -> str:
    """The pub/sub channel a node's long-poll listens to."""
    return channel_prefix() + node_id


def _redis() -> redis.Redis | None:
    global _client
    if not settings.REDIS_URL:
        return None
    if _client is None:
        # Short timeouts: a publish runs after a commit, on the caller's time.
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    return _client


def publish(node_id: str) -> int:
    """Tell the long-polls of a node that work is waiting; how many listeners heard it.

    Never raises: the command is committed whatever happens here, and a
    wakeup lost to a Redis hiccup only makes the agent wait for its interval.
    """
    client = _redis()
    if client is None:
        return 0
    try:
        return int(client.publish(channel(node_id), b"work"))
    except redis.RedisError as e:
        log.warning("agent wakeup: could not publish for node %s: %s", node_id, e)
        return 0


def publish_on_commit(node_id: str) -> None:
    """Publish the node's wakeup once the current transaction commits (at once outside one).

    After the commit, never before: an agent woken before the command is
    visible would heartbeat, find nothing, and go back to its interval.
    """
    if _redis() is None:
        return
    transaction.on_commit(lambda: publish(node_id))
