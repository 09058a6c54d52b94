"""scripts/check_imports.py, `make run`'s install step: silent when every module imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cleanenv import REPO, clean_env

pytestmark = pytest.mark.slow


def check(*args: str) -> subprocess.CompletedProcess:
    env = clean_env(PYTHONPATH=str(REPO))
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LLMGW_VAR_DIR"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "scripts/check_imports.py", *args], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_an_install_that_imports_prints_nothing():
    # The gateway's "starting" line and whitenoise's missing static folder were printed here on success.
    done = check()
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_verbose_says_how_many_modules_imported():
    done = check("--agent", "-v")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("import check: ") and done.stdout.endswith(" modules imported\n")
    assert done.stderr == ""
