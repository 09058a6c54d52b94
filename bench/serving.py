"""The gateway's CPU per request under each way of serving it, beside vLLM's router, in one run.

One echo replica answering at once; each front in turn offered
BENCH_SERVING_RATE (300) requests a second for BENCH_SERVING_SECONDS (2),
not streamed and streamed, BENCH_SERVING_RUNS (3) times: the CPU its
processes spent (user + system, from /proc, as getrusage counts it) over the
requests answered, min / median / max, the load average beside each run, and
for llmgw the share of it on the event loop's thread (the worker's main
thread; the rest is granian's own threads and the database pool's).

The fronts (BENCH_SERVING, default "native,asgi,rsgi,rsgi-st,rsgi-asyncio,vllm-router"):
the gateway's native server (gateway/native.py: one HTTP/1.1 server on the
worker's event loop, LLMGW_GATEWAY_INTERFACE=native), granian over ASGI
(gateway.asgi:app) and RSGI (gateway.rsgi:app), RSGI with granian's
single-threaded runtime, RSGI on asyncio's own event loop instead of uvloop,
and vLLM's router (`cache_aware`) when `make bench-peers` has installed it
under var/peers. Every llmgw front runs one worker under its master.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys

from bench.gateway import _SETUP, ROOT, Procs, _env, _steady, _wait
from bench.heartbeat import _free_port, _recreate_database
from bench.peers import PEERS_DIR, _answers, _start_vllm_router, cpu_seconds

GRANIAN = ["--workers", "1", "--no-ws", "--log-level", "warning", "--no-access-log"]
VARIANTS: dict[str, list[str]] = {
    "asgi": ["--interface", "asgi", "gateway.asgi:app"],
    "rsgi": ["--interface", "rsgi", "gateway.rsgi:app"],
    "rsgi-st": ["--interface", "rsgi", "gateway.rsgi:app", "--runtime-mode", "st"],
    "rsgi-asyncio": ["--interface", "rsgi", "gateway.rsgi:app", "--loop", "asyncio"],
}
# The gateway's own server: its command line (gateway/native.py), not granian's.
NATIVE = {"native": ["-m", "gateway.native", "--workers", "1", "--log-level", "warning"]}


def _ticks(pid: int) -> int:
    """User + system clock ticks of one thread (a process's main thread when `pid` is a process)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _worker(master: int) -> int | None:
    """The worker under `master` (its one child, granian's or the native server's), if there is one."""
    try:
        with open(f"/proc/{master}/task/{master}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def run() -> list[str]:
    """Each front's CPU per request, BENCH_SERVING_RUNS times; min / median / max and the load."""
    runs = int(os.environ.get("BENCH_SERVING_RUNS", 3))
    rate = float(os.environ.get("BENCH_SERVING_RATE", 300))
    seconds = float(os.environ.get("BENCH_SERVING_SECONDS", 2))
    names = os.environ.get("BENCH_SERVING", ",".join([*NATIVE, *VARIANTS, "vllm-router"])).split(",")
    env = _env()
    _recreate_database(env["DATABASE_URL"])
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    procs = Procs()
    lines: list[str] = []
    figures: dict[str, list[float]] = {}
    loads: list[float] = []
    try:
        echo = procs.echo(env, "bench", "--token-seconds", "0", "--prefill-tokens-per-s", "0", "--max-batch", "0")
        key = subprocess.run([sys.executable, "-c", _SETUP], cwd=ROOT, env=env, input=json.dumps({"bench": [echo]}),
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        fronts: dict[str, tuple[str, int]] = {}
        for name in names:
            if name == "vllm-router":
                exe = PEERS_DIR / "vllm-router" / "bin" / "vllm-router"
                if not exe.exists():
                    lines.append("vllm-router: not installed (make bench-peers installs it); left out")
                    continue
                url = _start_vllm_router(procs, exe, [echo], ROOT)
                pid = procs.procs[-1].pid
            else:
                port = _free_port()
                if name in NATIVE:
                    argv = [sys.executable, *NATIVE[name], "--host", "127.0.0.1"]
                else:
                    argv = [sys.executable, "-m", "granian", *VARIANTS[name], *GRANIAN, "--host", "127.0.0.1"]
                pid = procs.start([*argv, "--port", str(port)], env, f"serving-{name}-{port}").pid
                url = f"http://127.0.0.1:{port}"
            _wait(_answers(url, key, "bench"), timeout=180)
            fronts[name] = (url, pid)
        for _ in range(runs):
            loads.append(os.getloadavg()[0])
            for stream in (False, True):
                kind = "streamed" if stream else "not streamed"
                for name, (url, pid) in fronts.items():
                    asyncio.run(_steady(url, key, "bench", 100, 1, stream))  # warm the pools
                    worker = _worker(pid) if name in VARIANTS or name in NATIVE else None
                    cpu, loop = cpu_seconds(pid), _ticks(worker) if worker else 0
                    lat, _errors = asyncio.run(_steady(url, key, "bench", rate, seconds, stream))
                    cpu = cpu_seconds(pid) - cpu
                    if not lat:
                        continue
                    figures.setdefault(f"{name}: CPU ms per request, {kind}", []).append(cpu * 1000 / len(lat))
                    if worker and cpu:
                        share = (_ticks(worker) - loop) / os.sysconf("SC_CLK_TCK") / cpu
                        figures.setdefault(f"{name}: event loop thread's share of it, {kind}", []).append(share)
    finally:
        procs.stop()
    lines.append(f"{runs} runs at {rate:g}/s for {seconds:g} s; load average (1 min) at each run's start: "
                 + ", ".join(f"{x:.2f}" for x in loads))  # fmt: skip
    for k, v in figures.items():
        lines.append(f"{k}: min {min(v):.3f} / median {statistics.median(v):.3f} / max {max(v):.3f}")
    return lines
