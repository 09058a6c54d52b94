"""The Makefile's install stamp: redone when the requirements change, and
never left behind by an install whose modules do not import; and `make test`'s
migrations check, quiet before any database exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.cleanenv import REPO, clean_env, make_venv

STAMP = ".venv/.installed"


def make(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture
def project(tmp_path) -> Path:
    """The Makefile and what its install step reads, without the project's packages."""
    for rel in ("Makefile", "pyproject.toml", "scripts/check_imports.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, tmp_path / rel)
    return tmp_path


def set_mtime(path: Path, when: float) -> None:
    os.utime(path, (when, when))


def test_the_stamp_is_redone_when_requirements_change(project):
    (project / "requirements.txt").write_text("Django==5.2.19\n")
    (project / ".venv/bin").mkdir(parents=True)
    (project / ".venv/bin/python").touch(mode=0o755)
    (project / STAMP).touch()
    now = time.time()
    for rel in ("Makefile", "pyproject.toml", "scripts/check_imports.py"):
        set_mtime(project / rel, now - 100)
    set_mtime(project / "requirements.txt", now - 100)
    set_mtime(project / STAMP, now - 50)
    dry = make(project, "-n", STAMP)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip() == f"make: '{STAMP}' is up to date."
    # A pull that adds a requirement makes the next `make run` install again, then check.
    set_mtime(project / "requirements.txt", now)
    recipe = make(project, "-n", STAMP).stdout.splitlines()
    assert recipe == [
        ".venv/bin/python -m pip install --quiet -r requirements.txt",
        "PYTHONPATH=. .venv/bin/python scripts/check_imports.py",
        f"touch {STAMP}",
    ]


@pytest.mark.slow
def test_an_install_whose_modules_do_not_import_is_not_marked_done(project):
    # A real virtualenv and a requirements file that forgets Django: pip succeeds,
    # the import check fails, and the stamp must not claim the install worked.
    make_venv(project / ".venv")
    (project / "requirements.txt").write_text("# forgot everything\n")
    (project / "llmgw").mkdir()
    (project / "llmgw/__init__.py").write_text("")
    first = make(project, STAMP)
    assert first.returncode != 0
    assert "import check" in first.stderr or "No module named 'django'" in first.stderr, first.stderr
    assert not (project / STAMP).exists()
    # Running it again tries again, rather than trusting a stamp.
    second = make(project, "-n", STAMP)
    assert "pip install --quiet -r requirements.txt" in second.stdout


def migrations_check(**variables: str) -> str:
    """`make test`'s makemigrations line, as make expands it (with any make variables given)."""
    dry = subprocess.run(
        ["make", "-n", "test", *(f"{k}={v}" for k, v in variables.items())],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = [line for line in dry.stdout.splitlines() if "manage.py makemigrations --check" in line]
    return line


def test_the_migrations_check_is_quiet_where_no_database_exists_yet():
    # As on a fresh `make test`: the configured database is absent until pytest creates its own.
    env = clean_env(DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/llmgw_absent_{uuid.uuid4().hex[:8]}")
    run = subprocess.run(
        ["bash", "-c", migrations_check()], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "No changes detected"
    assert "does not exist" not in run.stderr and "Warning" not in run.stderr, run.stderr
    # A server that does not answer is still said (and the check of the files still passes).
    unreachable = migrations_check(MIGRATIONS_CHECK_DB="postgres://postgres@127.0.0.1:1/postgres")
    run = subprocess.run(["bash", "-c", unreachable], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Got an error checking a consistent migration history" in run.stderr


def test_make_test_builds_llama_server_and_names_it_to_pytest(tmp_path):
    env = clean_env(XDG_CACHE_HOME=str(tmp_path))
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert "PYTHON=.venv/bin/python ./scripts/llama-server.sh" in lines
    binary = f"LLMGW_LLAMA_SERVER={tmp_path}/llmgw/llama.cpp-11434/bin/llama-server"
    pytest_lines = [line for line in lines if "bin/pytest" in line]
    assert len(pytest_lines) == 2
    assert all(binary in line for line in pytest_lines)
    # Built before any test runs.
    assert lines.index("PYTHON=.venv/bin/python ./scripts/llama-server.sh") < lines.index(pytest_lines[0])


def test_make_test_installs_prometheus_before_the_tests(tmp_path):
    # tests/test_prometheus.py and tests/deploy/test_prometheus_rules.py run Debian's prometheus,
    # promtool and amtool: installed when missing, as Chromium is.
    env = clean_env(XDG_CACHE_HOME=str(tmp_path))
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    check = next(i for i, line in enumerate(lines) if line.startswith("test -x /usr/bin/prometheus"))
    assert "test -x /usr/bin/promtool && test -x /usr/bin/amtool" in lines[check]
    assert "apt-get install -y --no-install-recommends prometheus prometheus-alertmanager" in lines[check + 1]
    assert check < next(i for i, line in enumerate(lines) if "bin/pytest" in line)
