"""Debian's Prometheus and promtool for the tests (`make prometheus` installs them), and the shipped rules."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "llmgw.rules.yml"
RULE_TESTS = RULES_DIR / "llmgw.rules.test.yml"


def binary(name: str) -> str:
    """The path of `prometheus` or `promtool`; fails (never skips) when missing: `make test` installs them."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(f"{name} is missing: `make prometheus` installs Debian's prometheus package (make test does)")
    return path


def rules() -> list[dict[str, Any]]:
    """Every rule of the shipped rule file, recording and alerting, in order."""
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded() -> dict[str, str]:
    """Recording rules: recorded name -> expression."""
    return {r["record"]: r["expr"] for r in rules() if "record" in r}


# A metric name in PromQL: letters, digits, underscores and colons, not followed by "(" (a
# function) and not a label name inside braces, a keyword or a duration.
_NAME = re.compile(r"(?<![\w:.\"'=~!\[])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:]*\s*\()")
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan", "le",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (label matchers and grouping labels left out)."""
    # Drop label matchers and grouping lists: what is inside braces, and the lists after by/on/...
    text = re.sub(r"\{[^}]*\}", "", expr)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r'"[^"]*"', "", text)
    names = {m.group(1) for m in _NAME.finditer(text)}
    return {n for n in names if n.lower() not in _KEYWORDS and not re.fullmatch(r"\d+[smhdwy]?", n)}


def expanded(expr: str) -> str:
    """The expression with each recorded name it reads replaced by the recording rule's own expression."""
    rules_ = recorded()
    for _ in range(len(rules_)):
        new = re.sub(r"llmgw:[a-z0-9_:]+", lambda m: f"({rules_.get(m.group(0), m.group(0))})", expr)
        if new == expr:
            break
        expr = new
    return expr
