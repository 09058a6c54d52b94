"""The figures the gateways share for the admin: through Redis, or the embedded default's cache without it."""

from __future__ import annotations

import uuid

import pytest
from django.core.cache import cache

from gateway import figures
from tests.gateway.conftest import chat, make_deployment, make_key, url_of, wait_for


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


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_gateway_without_redis_shares_its_figures_through_the_file_cache(
    gateway_factory, echoes, user, tmp_path, settings
):
    """The embedded default: the data plane's scrape reaches the admin's read through the shared var directory."""
    srv = echoes()
    (rep,) = make_deployment("demo", [url_of(srv)])
    key = make_key(user)
    gw = gateway_factory("no-redis", refresh_s=0.5, extra_env={"REDIS_URL": "", "LLMGW_VAR_DIR": str(tmp_path)})
    gw.wait_ready(key, "demo", 1)
    # This process reads as the web process of that installation would: the same file cache, no Redis.
    settings.REDIS_URL = ""
    settings.CACHES = {"default": {"BACKEND": "llmgw.file_cache.FileCache", "LOCATION": str(tmp_path / "cache")}}
    with gw.client(key) as c:
        assert c.post("/v1/chat/completions", json=chat("hello")).status_code == 200
    seen = wait_for(lambda: figures.read([str(rep.id)]).get(str(rep.id)), timeout=10, what=gw.tail)
    assert (seen.inflight, seen.ejected_for_s, seen.failures) == (0, 0.0, 0)
