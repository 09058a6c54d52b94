"""Run llmgw's benchmarks and print their figures.

Each benchmark is a module under bench/ with `run() -> list[str]` returning
the lines to print. `python -m bench NAME ...` runs some of them.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

BENCHES: list[str] = [
    "heartbeat",
    "register",
    "lease",
    "lease_db",
    "planner",
    "reconcile",
    "kept",
    "metrics",
    "doctor",
    "gateway",
]
# Run only when named: the whole loop with a simulated fleet takes minutes, and
# the gateway's peers are installed from PyPI (make bench-peers); autoscale runs a
# load of minutes.
ON_REQUEST: list[str] = ["fleet", "peers", "autoscale", "faults", "serving"]


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings_test")
    if argv[:1] == ["faults"]:
        # Scenario names follow (bench/faults.py), each line printed as its scenario ends.
        return importlib.import_module("bench.faults").main(argv[1:])
    names = argv or BENCHES
    unknown = [n for n in names if n not in BENCHES + ON_REQUEST]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHES + ON_REQUEST)}", file=sys.stderr)
        return 2
    for name in names:
        started = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        print(f"== {name}")
        for line in module.run():
            print(f"   {line}", flush=True)
        print(f"   ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
