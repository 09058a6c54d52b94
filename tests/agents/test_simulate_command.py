"""manage.py simulate: a fleet against a running control plane, stopped whole by Ctrl-C or SIGTERM."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agents import credentials
from inventory.models import Node
from tests.llmgw_agent.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REPO = Path(__file__).resolve().parents[2]


def _kill_leftover_agents(workdir: Path) -> None:
    """Should the command fail to stop its agents, the test must not leave them running."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(workdir).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _ignore_sigint():
    # As a shell starts a command in the background.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("sig", "preexec"),
    [(signal.SIGTERM, None), (signal.SIGINT, _ignore_sigint), (signal.SIGHUP, None)],
    ids=["sigterm", "sigint-started-in-background", "sighup"],
)
def test_simulated_agents_register_and_stop_with_the_command(live_server, tmp_path, sig, preexec):
    now = dt.datetime.now(dt.UTC)
    _, join = credentials.create_join_token(name="sim", expires_at=now + dt.timedelta(hours=1), max_uses=2, now=now)
    workdir = tmp_path / "sim"
    proc = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "simulate",
            "--nodes=2",
            f"--control-plane={live_server.url}",
            f"--join-token={join}",
            "--profiles=cpu-only",
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
    )
    try:
        wait_for(lambda: Node.objects.count() == 2, timeout=30)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftover_agents(workdir)
    text = out.decode()
    assert "2 agents reporting to" in text and "stopping the simulated agents" in text
    assert sorted(Node.objects.values_list("id", flat=True)) == ["sim-cpu-only-00", "sim-cpu-only-01"]
    for node in ("sim-cpu-only-00", "sim-cpu-only-01"):
        # Each agent was told to stop, and did: none outlives the command.
        log = (workdir / node / "agent.log").read_text()
        assert "SIGTERM: stopping" in log, log[-2000:]
