"""Momentary telemetry lives in the cache with a lifetime, never for good."""

from django.core.cache import cache

from inventory import telemetry


def test_telemetry_expires(settings):
    settings.LLMGW_TELEMETRY_TTL = 90
    telemetry.put("n1", {"at": 1.0, "ib_ports": []})
    client = cache._cache.get_client(write=False)
    assert 0 < client.ttl(cache.make_and_validate_key(telemetry.key("n1"))) <= 90
    assert telemetry.get("n1") == {"at": 1.0, "ib_ports": []}
    assert telemetry.get_many(["n1", "n2"]) == {"n1": {"at": 1.0, "ib_ports": []}}
