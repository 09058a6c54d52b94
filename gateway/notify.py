"""Push to the data planes: a message on a Redis channel when keys or replicas change.

A message only says what kind of thing changed; each data plane then reloads
that part of its table. A lost message is healed by the data plane's periodic
full refresh (LLMGW_GATEWAY_REFRESH seconds). Without Redis (the embedded
default) nothing is pushed and the periodic refresh is all there is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from django.conf import settings

from placement.signals import replicas_changed

log = logging.getLogger(__name__)

_client: redis.Redis | None = None


def channel() -> str:
    """The pub/sub channel, under the install's cache prefix so installs sharing a Redis stay apart."""
    return f"{settings.LLMGW_CACHE_PREFIX}:gateway"


def _redis() -> redis.Redis | None:
    global _client
    if not settings.REDIS_URL:
        return None
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    return _client


def publish(kind: str) -> int:
    """Tell every data plane that `kind` ("keys" or "routes") changed; the number that heard it.

    A failure to publish is logged, never raised: the change is committed and
    the periodic refresh will carry it.
    """
    client = _redis()
    if client is None:
        return 0
    try:
        return int(client.publish(channel(), json.dumps({"kind": kind})))
    except redis.RedisError as e:
        log.warning("gateway: could not publish a %s change: %s", kind, e)
        return 0


def _on_replicas_changed(sender: Any, **kwargs: Any) -> None:
    publish("routes")


def connect() -> None:
    """Follow placement's replica changes (called once, from the app's ready())."""
    replicas_changed.connect(_on_replicas_changed, dispatch_uid="gateway.notify.replicas")
