"""Which inference engines are installed, and at what version."""

from __future__ import annotations

import re
from pathlib import Path

from .tools import run_tool

# engine -> (argv, recording name)
PROBES: dict[str, tuple[list[str], str]] = {
    "vllm": (["vllm", "--version"], "vllm_--version"),
    "sglang": (["python3", "-c", "import sglang; print(sglang.__version__)"], "sglang_version"),
    "llama-server": (["llama-server", "--version"], "llama-server_--version"),
}
_VERSION = re.compile(r"(?:version:?\s*)?v?(\d+(?:\.\d+)*(?:[.+-][0-9A-Za-z.+-]+)?(?:\s*\([0-9a-f]+\))?)")


def parse_version(engine: str, text: str) -> str:
    """The version an engine's probe prints ("0.6.3.post1", "4589 (1a2b3c4)" for llama.cpp builds)."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("INFO", "WARNING", "DEBUG")):
            continue
        if engine == "llama-server" and not line.lower().startswith("version"):
            continue
        m = _VERSION.search(line)
        if m:
            return m.group(1).strip()
    return ""


def probe_engines(root: Path | None, *, timeout: float = 20.0) -> tuple[dict[str, str], list[str]]:
    """Installed engines and their versions; an engine that is absent is simply not listed."""
    versions: dict[str, str] = {}
    problems: list[str] = []
    for engine, (argv, record) in PROBES.items():
        res = run_tool(argv, root=root, timeout=timeout, record=record)
        if not res.ok:
            # Absent: no program, or no module of the engine's own name (a module
            # the engine itself imports missing is a broken install, and reported).
            if not res.missing and f"No module named '{engine}'" not in res.error:
                problems.append(f"engine {engine}: {res.error}")
            continue
        v = parse_version(engine, res.stdout)
        if v:
            versions[engine] = v
    return versions, problems
