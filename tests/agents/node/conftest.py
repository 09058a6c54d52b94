from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "hardware"
PROFILES = REPO / "agents" / "node" / "profiles"


@pytest.fixture
def fixture_text():
    return lambda rel: (FIXTURES / rel).read_text()
