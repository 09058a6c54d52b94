"""Requests in flight on the embedded default: no Redis, each router's counts in a file of its own."""

from __future__ import annotations

from placement import inflight


def test_without_redis_routers_report_through_files(settings, tmp_path):
    # The embedded default: no Redis, so each router's counts are a file of its own under var/.
    settings.REDIS_URL = ""
    settings.VAR_DIR = tmp_path
    assert inflight.totals(now=1000.0) == inflight.Totals(0, {})
    inflight.report_file("gw1", {"r1": 2, "r2": 1}, now=1000.0)
    inflight.report_file("gw2", {"r1": 3}, now=1001.0)
    assert inflight.totals(now=1002.0) == inflight.Totals(2, {"r1": 5, "r2": 1})
    # A router that stopped renewing (it died) counts no more once its report is older than the TTL.
    assert inflight.totals(now=1000.0 + inflight.REPORT_TTL_S + 0.5) == inflight.Totals(1, {"r1": 3})
    inflight.report_file("gw2", None)
    assert inflight.totals(now=1002.0) == inflight.Totals(1, {"r1": 2, "r2": 1})
    assert sorted(p.name for p in (tmp_path / "inflight").iterdir()) == ["gw1.json"]
