"""The data plane's Prometheus families, and the Grafana dashboard's gateway panels reading exactly them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from django.conf import settings
from prometheus_client import generate_latest

from gateway.dataplane.metrics import Metrics
from tests.deploy.prometheus import expanded


def _exposed() -> set[str]:
    m = Metrics()
    m.requests.labels("demo", "200").inc()
    m.tokens.labels("demo", "prompt").inc(3)
    m.ttft.labels("demo").observe(0.1)
    m.duration.labels("demo").observe(0.2)
    m.inflight.labels("r1").set(2)
    m.ejected.labels("r1").set(0)
    m.retries.inc()
    text = generate_latest(m.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_families_the_issue_names():
    exposed = _exposed()
    assert {
        "llmgw_gateway_requests_total",
        "llmgw_gateway_tokens_total",
        "llmgw_gateway_ttft_seconds_bucket",
        "llmgw_gateway_request_seconds_bucket",
        "llmgw_gateway_inflight",
        "llmgw_gateway_replica_ejected",
        "llmgw_gateway_retries_total",
        "llmgw_gateway_upstream_reopened_total",
    } <= exposed


def test_dashboard_gateway_panels_use_only_exposed_families():
    dash = json.loads((Path(settings.BASE_DIR) / "deploy" / "grafana" / "llmgw.json").read_text())
    # What the recording rules they read (deploy/prometheus/llmgw.rules.yml) read themselves.
    exprs = [expanded(t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"llmgw_gateway_[a-z_]+", e)}
    assert used == {
        "llmgw_gateway_requests_total",
        "llmgw_gateway_tokens_total",
        "llmgw_gateway_ttft_seconds_bucket",
        "llmgw_gateway_request_seconds_bucket",
        "llmgw_gateway_inflight",
        "llmgw_gateway_replica_ejected",
    }
    assert used <= _exposed()
