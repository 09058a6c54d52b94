from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hardware"
PROFILES = REPO / "llmgw_sim" / "profiles"


@pytest.fixture
def fixture_text():
    return lambda rel: (FIXTURES / rel).read_text()
