"""The agent's systemd unit: what its comments promise exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_units_docs_pointer_names_a_real_section():
    unit = (ROOT / "deploy" / "llmgw-agent.service").read_text()
    m = re.search(r'see (docs/[\w.-]+\.md) \("([^"]+)"\)', unit)
    assert m is not None, "the unit's first comment points to a section of the docs"
    page = ROOT / m.group(1)
    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
    assert m.group(2) in headings
