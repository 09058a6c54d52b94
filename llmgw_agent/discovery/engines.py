"""Which inference engines are installed, and at what version: each asked as the engine registry says."""

from __future__ import annotations

from pathlib import Path

from llmgw_wire import engines as wire_engines

from .tools import run_tool


def probe_engines(root: Path | None, *, timeout: float = 20.0, live: bool = False) -> tuple[dict[str, str], list[str]]:
    """Installed engines (canonical names) and their versions; an engine that is absent is simply not listed.

    `live` probes the real programs even when the hardware comes from a
    recorded profile at `root` (a simulated node running a real engine).
    """
    versions: dict[str, str] = {}
    problems: list[str] = []
    for engine in wire_engines.ENGINES.values():
        if engine.probe is None:
            continue
        argv = list(engine.probe.argv)
        res = run_tool(argv, root=None if live else root, timeout=timeout, record=engine.probe.record)
        if not res.ok:
            # Absent: no program, or no module of the engine's own name (a module
            # the engine itself imports missing is a broken install, and reported).
            if not res.missing and f"No module named '{engine.name}'" not in res.error:
                problems.append(f"engine {engine.name}: {res.error}")
            continue
        v = wire_engines.probe_version(engine, res.stdout, res.stderr)
        if v.text:
            versions[engine.name] = v.text
        else:
            problems.append(f"engine {engine.name}: {' '.join(argv)} printed no version on {engine.probe.stream}")
    return versions, problems
