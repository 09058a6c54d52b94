"""The data plane's /metrics is guarded as the control plane's is: a scraper's bearer token or an allowed address.

It names every model and replica and counts their traffic, and it is served on the
port every client reaches: an API key is not a scraper's token.
"""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import make_key

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TOKEN = "gateway-scrape-secret"


@pytest.fixture(scope="module")
def closed(gateway_factory):
    """A data plane with a scrape token and no allowed address (the test settings allow loopback)."""
    return gateway_factory("closed", extra_env={"LLMGW_METRICS_TOKEN": TOKEN, "LLMGW_METRICS_ALLOW": ""})


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"] == "application/json"
    return r.json()["error"]


def test_a_scrape_without_the_token_is_refused_with_an_openai_shaped_401(closed, user):
    url = f"{closed.url}/metrics"
    key = make_key(user)
    refused = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}"}, {"Authorization": TOKEN})
    for headers in refused:
        r = httpx.get(url, headers=headers, timeout=5)
        assert (r.status_code, r.headers["www-authenticate"]) == (401, 'Bearer realm="llmgw-metrics"'), headers
        assert _error(r) == {
            "message": "metrics need a bearer token or an allowed address",
            "type": "authentication_error",
            "param": None,
            "code": "metrics_refused",
        }
        assert "llmgw_gateway" not in r.text


def test_the_token_reads_the_metrics(closed):
    r = httpx.get(f"{closed.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE llmgw_gateway_requests_total counter" in r.text


def test_an_allowed_address_reads_the_metrics_without_a_token(gateway):
    # The suite's settings allow loopback (LLMGW_METRICS_ALLOW), as an operator lists Prometheus' address.
    r = httpx.get(f"{gateway.url}/metrics", timeout=5)
    assert r.status_code == 200
    assert "# TYPE llmgw_gateway_requests_total counter" in r.text
