"""The shipped rules: promtool checks and unit-tests them, each alert has its runbook, Alertmanager routes them.

promtool's own cases (deploy/prometheus/llmgw.rules.test.yml) put input series through
every alert, once quiet and once firing; tests/test_prometheus.py runs the same rules
in a real Prometheus scraping a live fleet.
"""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.prometheus import ROOT, RULE_TESTS, RULES, RULES_DIR, binary, recorded, rules

ALERTS_DOC = ROOT / "docs" / "alerts.md"
ALERTMANAGER = RULES_DIR / "alertmanager.example.yml"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=RULES_DIR)


def test_promtool_checks_the_rules():
    done = run(binary("promtool"), "check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass():
    done = run(binary("promtool"), "test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_tested_quiet_and_firing():
    cases = [t for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in test.get("alert_rule_test", [])]
    alerts = [r["alert"] for r in rules() if "alert" in r]
    for name in alerts:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no case where it stays quiet"
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no case where it fires"
    assert {c["alertname"] for c in cases} == set(alerts)


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section():
    doc = ALERTS_DOC.read_text()
    headings = re.findall(r"^## (\S+)$", doc, re.MULTILINE)
    table = re.findall(r"^\| (Llmgw\w+) \| (\w+) \|", doc, re.MULTILINE)
    alerts = [r for r in rules() if "alert" in r]
    assert headings == [r["alert"] for r in alerts]
    assert table == [(r["alert"], r["labels"]["severity"]) for r in alerts]
    for r in alerts:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert set(r["annotations"]) == {"summary", "runbook_url"}, r["alert"]
        # GitHub's anchor of the heading "## LlmgwNodeLost" is "#llmgwnodelost".
        assert r["annotations"]["runbook_url"] == f"docs/alerts.md#{r['alert'].lower()}"
        # An operator reads what happened and what to do: a sentence of each at least.
        assert r["annotations"]["summary"].count(". ") + r["annotations"]["summary"].count(": ") >= 1, r["alert"]


def test_recorded_names_follow_the_level_metric_operation_convention():
    for name in recorded():
        assert re.fullmatch(r"llmgw:[a-z0-9_]+(:[a-z0-9_]+)?", name), name


def test_amtool_accepts_the_alertmanager_example_and_it_routes_by_severity():
    amtool = binary("amtool")
    done = run(amtool, "check-config", str(ALERTMANAGER))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    for severity, receiver in (("critical", "on-call"), ("warning", "team-chat")):
        routed = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", f"severity={severity}")
        assert routed.returncode == 0, routed.stdout + routed.stderr
        assert routed.stdout.strip() == receiver
    # Every alert it names exists.
    named = set(re.findall(r"Llmgw\w+", ALERTMANAGER.read_text()))
    assert named <= {r["alert"] for r in rules() if "alert" in r}
