"""The node agent runs on GPU nodes without Django: importing it must not pull Django in."""

from __future__ import annotations

import subprocess
import sys


def test_agent_modules_import_no_django():
    code = (
        "import sys\n"
        "import llmgw_agent.__main__, llmgw_agent.config, llmgw_agent.engines, llmgw_sim.echo\n"
        "import llmgw_agent.loop, llmgw_agent.supervisor, llmgw_agent.metrics\n"
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    assert out.stdout.strip() == ""
