"""The node agent runs on GPU nodes without Django: importing it must not pull Django in."""

from __future__ import annotations

import subprocess
import sys


def test_agent_modules_import_no_django():
    code = (
        "import sys\n"
        "import agents.node.__main__, agents.node.config, agents.node.engines, agents.node.echo\n"
        "import agents.node.loop, agents.node.supervisor, agents.node.metrics\n"
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    assert out.stdout.strip() == ""
