"""The figures the gateways share for the admin: through Redis, or the embedded default's cache without it."""

from __future__ import annotations

import uuid

from django.core.cache import cache

from gateway import figures


def test_without_redis_each_replicas_figures_are_a_cache_entry_of_their_own(settings):
    settings.REDIS_URL = ""
    a, b, never = (str(uuid.uuid4()) for _ in range(3))
    figures.publish_cache(
        {a: figures.Figures(7, 2, 0.4375, 0.75, 3, 0.0, 0), b: figures.Figures(None, None, None, None, 0, 25.0, 4)}
    )
    assert figures.read([a, b, never]) == {
        a: figures.Figures(7, 2, 0.4375, 0.75, 3, 0.0, 0),
        b: figures.Figures(None, None, None, None, 0, 25.0, 4),
    }
    # A later scrape replaces what an earlier one shared, replica by replica.
    figures.publish_cache({a: figures.Figures(1, 0, 0.1, None, 0, 0.0, 0)})
    assert figures.read([a])[a].running == 1
    assert figures.read([]) == {} and figures.read() == {}
    cache.delete_many([f"gateway:replica:{rid}" for rid in (a, b)])
    assert figures.read([a, b]) == {}
