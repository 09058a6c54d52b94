"""The package installs and imports on a clean machine: the control plane with
`pip install .`, the agent alone from deploy/agent, each in a virtualenv that
holds nothing but what it declares (scripts/check_imports.py imports every
module there)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.cleanenv import REPO, clean_env, copy_tracked_files, make_venv, run

# OpenAI's Agents SDK, installed beside the node agent (its import name is `agents`).
OPENAI_AGENTS = "openai-agents==0.24.0"

# Every top-level package but the tests and the benchmarks: a new app is shipped or this fails.
PROJECT_PACKAGES = tuple(
    sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in ("tests", "bench"))
)


def pins(lines: list[str]) -> dict[str, str]:
    """{lower-case name: version} of `name==version` requirement lines."""
    found = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def test_pyproject_lists_every_package_on_disk():
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in PROJECT_PACKAGES
        for p in (REPO / top).rglob("__init__.py")
    }
    assert on_disk - declared == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert declared - on_disk == {"llmgw.templates"}


def test_pyproject_reads_its_dependencies_from_requirements_txt():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["dependencies"]
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}


def test_agent_distribution_pins_what_the_control_plane_pins():
    agent = tomllib.loads((REPO / "deploy/agent/pyproject.toml").read_text())["project"]
    run_pins = pins((REPO / "requirements.txt").read_text().splitlines())
    agent_pins = pins(agent["dependencies"])
    assert sorted(agent_pins) == ["httpx", "nvidia-ml-py", "pydantic", "pyyaml"]
    assert agent_pins == {name: run_pins[name] for name in agent_pins}
    assert agent["scripts"] == {"llmgw-agent": "llmgw_agent.__main__:main"}
    assert (REPO / "deploy/agent/llmgw_agent").resolve() == REPO / "llmgw_agent"
    assert (REPO / "deploy/agent/llmgw_wire").resolve() == REPO / "llmgw_wire"


def test_agent_distribution_needs_no_build_hook():
    # A hook that filters modules out of a package is how control-plane code once reached nodes by
    # accident: the agent's packages hold only what a node runs, so the list is the whole story.
    assert sorted(p.name for p in (REPO / "deploy/agent").iterdir()) == ["llmgw_agent", "llmgw_wire", "pyproject.toml"]
    packages = tomllib.loads((REPO / "deploy/agent/pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert packages == ["llmgw_wire", "llmgw_wire.engines", "llmgw_agent", "llmgw_agent.discovery"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return copy_tracked_files(tmp_path_factory.mktemp("checkout"))


@pytest.mark.slow
def test_pip_install_gives_a_control_plane_that_imports_every_module(checkout, tmp_path):
    bin_dir = make_venv(tmp_path / "venv")
    run([str(bin_dir / "pip"), "install", "--quiet", str(checkout)], cwd=tmp_path)
    # Run from elsewhere, so that the installed copy is imported, not the checkout's.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run([str(bin_dir / "python"), str(checkout / "scripts/check_imports.py"), "-v"], cwd=elsewhere)
    count = int(re.search(r"import check: (\d+) modules imported", out).group(1))
    assert count > 100
    site = next((tmp_path / "venv/lib").glob("python3.*/site-packages"))
    assert (site / "llmgw/templates/admin/nvlink.html").is_file()
    assert (site / "llmgw_sim/profiles/hgx-h100").is_dir()
    assert (bin_dir / "llmgw-agent").exists()
    # docs/operations.md's way to run an installed copy: its state goes to ./var where it runs, not site-packages.
    env = {k: v for k, v in clean_env().items() if k not in ("DATABASE_URL", "REDIS_URL", "LLMGW_VAR_DIR")}
    env |= {"DJANGO_SETTINGS_MODULE": "llmgw.settings", "DEBUG": "1"}
    run([str(bin_dir / "django-admin"), "migrate", "--noinput"], cwd=elsewhere, env=env)
    assert (elsewhere / "var/llmgw.sqlite3").is_file()
    assert not (site / "var").exists()


@pytest.mark.slow
def test_the_agent_installs_alone_without_django_and_beside_openai_agents(checkout, tmp_path):
    bin_dir = make_venv(tmp_path / "venv")
    # docs/agent.md's node install, step 2.
    run([str(bin_dir / "pip"), "install", "--quiet", str(checkout / "deploy/agent")], cwd=tmp_path)
    helped = run([str(bin_dir / "llmgw-agent"), "--help"], cwd=tmp_path)
    assert helped.startswith("usage: llmgw-agent ")
    out = run([str(bin_dir / "python"), str(checkout / "scripts/check_imports.py"), "--agent", "-v"], cwd=tmp_path)
    assert re.search(r"import check: \d+ modules imported", out)
    installed = run([str(bin_dir / "pip"), "list", "--format=freeze"], cwd=tmp_path, env=clean_env())
    names = {line.split("==")[0].lower() for line in installed.splitlines() if "==" in line}
    assert {"httpx", "pydantic", "pyyaml", "nvidia-ml-py", "llmgw-agent"} <= names
    assert not names & {"django", "celery", "djangorestframework", "psycopg"}
    site = next((tmp_path / "venv/lib").glob("python3.*/site-packages"))
    # Two top-level names, neither one another library uses; no simulator, no echo engine on a node.
    ours = {p.name for p in site.iterdir() if p.name.startswith(("llmgw", "agents", "wire"))}
    assert {n for n in ours if not n.endswith(".dist-info")} == {"llmgw_agent", "llmgw_wire"}
    assert (site / "llmgw_wire/shard_states.py").is_file()
    # The engine registry travels with the agent: it builds every command line from it.
    assert (site / "llmgw_wire/engines/registry.py").is_file()
    # Asked for the echo engine anyway, the agent says what is missing instead of a ModuleNotFoundError.
    probe = (
        "import llmgw_wire as w; from llmgw_agent import engines;"
        "p = w.EngineProfile(name='e', engine='echo', model_path='m');"
        "s = w.StartShard(shard_id='s1', replica_id='r1', profile=p, http_port=18001, gpu_indices=[]);"
        "engines.build(s)"
    )
    proc = subprocess.run(
        [str(bin_dir / "python"), "-c", probe], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "llmgw_wire.engines.launch.EngineError: shard s1: the echo engine is a development tool (llmgw_sim, "
        "in llmgw's source) and this node's agent was installed without it: deploy a real engine, or run the agent "
        "from a checkout"
    )
    # OpenAI's Agents SDK imports as `agents`: the name the node agent's package once had, so the two
    # could not share an environment (whichever installed last replaced the other's files).
    run([str(bin_dir / "pip"), "install", "--quiet", OPENAI_AGENTS], cwd=tmp_path)
    both = (
        "import agents, llmgw_agent.loop, llmgw_wire;"
        "print(agents.Agent.__module__, llmgw_agent.loop.Agent.__module__, llmgw_wire.Heartbeat.__module__)"
    )
    out = run([str(bin_dir / "python"), "-c", both], cwd=tmp_path)
    assert out.split() == ["agents.agent", "llmgw_agent.loop", "llmgw_wire.heartbeat"]
    assert run([str(bin_dir / "llmgw-agent"), "--help"], cwd=tmp_path).startswith("usage: llmgw-agent ")
