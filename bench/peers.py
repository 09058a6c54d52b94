"""llmgw's gateway beside its peers, on the same echo replicas and the same load, in one run.

The peers are the ones the gateway's issue names: vLLM's router (PyPI
`vllm-router`, its `cache_aware` policy) and LiteLLM's proxy (PyPI
`litellm[proxy]`, its default routing). Each is installed from PyPI with pip
into a virtual environment of its own under var/peers/<name> (never into the
project's), once; a peer that cannot be installed or started is reported as
such and left out, and the others still run. Everything listens on loopback.

1. Overhead: one echo replica answering at once; the same requests straight
   to it and through each front, streamed and not, at BENCH_PEERS_RATE
   (default 500) requests a second for BENCH_PEERS_SECONDS (default 3):
   added latency p50/p99 (front minus direct, measured just before). Then
   each front's highest offered rate (stepping up) held with p99 under 50 ms
   and no errors, streamed, and its throughput with BENCH_PEERS_CLIENTS (64)
   clients streaming back to back. Each front's CPU per request (its
   processes' user + system time over the requests it answered) in the
   offered-rate phases. llmgw runs once per way of serving it
   (BENCH_PEERS_INTERFACES, default "native,asgi": the gateway's own server, as
   scripts/gateway.sh serves it, then, as "llmgw asgi", granian's ASGI).
2. Routing quality: bench.gateway's workloads (BENCH_PEERS_WORKLOADS, default
   "short,sessions,long,shared") over 4 fresh echo replicas per front (llmgw
   served the first of BENCH_PEERS_INTERFACES' ways):
   prefix-cache hit ratio from the replicas' own counters, mean time to first
   token, each replica's share of the requests, the front's CPU per request.
   vLLM's router runs twice: with the replicas answering vLLM's /tokenize and
   render routes as vLLM does (its policy at full strength), and with them
   answering 404 (its fallback, as in front of an engine without them).
Each part runs BENCH_PEERS_RUNS times (default 3): min / median / max, and
llmgw's ratio to each peer. BENCH_PEERS (default "vllm-router,litellm") picks the peers ("none": llmgw alone).
Every failed request is reported with its status and body, or its exception,
and every process's output is kept under BENCH_LOGS (var/bench-logs).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from bench.gateway import (
    _SETUP,
    FAILURES,
    LOGS,
    ROOT,
    WORKLOADS,
    Procs,
    Workload,
    _cache_counters,
    _conversations,
    _env,
    _pct,
    _steady,
    _wait,
    ceiling,
    failure,
    failures_report,
)
from bench.heartbeat import _free_port, _recreate_database

PEERS_DIR = ROOT / "var" / "peers"
# What pip installs for each peer, and the command it then offers.
PEERS = {"vllm-router": ("vllm-router", "vllm-router"), "litellm": ("litellm[proxy]", "litellm")}
STEPS = (100, 200, 300, 500, 750, 1000, 1500, 2000, 3000)


def install(name: str) -> tuple[Path | None, str]:
    """The peer's command, installed into var/peers/<name> if it is not yet; (None, why) when it cannot be."""
    requirement, command = PEERS[name]
    venv = PEERS_DIR / name
    exe = venv / "bin" / command
    # Touched only once pip has finished: a half-done install is done again, not run.
    stamp = venv / ".installed"
    if stamp.exists() and exe.exists():
        return exe, "installed"
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True, capture_output=True, text=True, timeout=120)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", requirement], check=True,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        tail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[-1:] or [str(e)]
        return None, f"pip install {requirement} failed: {tail[0]}"
    if not exe.exists():
        return None, f"pip installed {requirement} but it offers no {command} command"
    stamp.touch()
    return exe, "installed now"


def _peer_env() -> dict[str, str]:
    # A clean environment: LiteLLM's proxy would take the project's DATABASE_URL
    # for a database of its own, and fetch its model price list from the internet.
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "NO_PROXY": "*",
    }


def _start_vllm_router(procs: Procs, exe: Path, urls: list[str], workdir: Path) -> str:
    port = _free_port()
    procs.start([str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                 "--worker-urls", *urls, "--log-level", "error", "--prometheus-port", str(_free_port())],
                _peer_env(), f"vllm-router-{port}")  # fmt: skip
    return f"http://127.0.0.1:{port}"


def _start_litellm(procs: Procs, exe: Path, urls: list[str], workdir: Path, model: str, key: str) -> str:
    config = workdir / f"litellm-{_free_port()}.json"
    deployments = [
        {"model_name": model, "litellm_params": {"model": f"openai/{model}", "api_base": f"{u}/v1", "api_key": "none"}}
        for u in urls
    ]
    config.write_text(json.dumps({"model_list": deployments}))
    port = _free_port()
    # It refuses to start without a master key (the key its clients then send).
    procs.start([str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                 "--num_workers", "1"], {**_peer_env(), "LITELLM_MASTER_KEY": key}, f"litellm-{port}")  # fmt: skip
    return f"http://127.0.0.1:{port}"


def cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in the process group (a front and its workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, ... utime and stime are the 12th and 13th.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _fronts(
    env: dict[str, str], procs: Procs, peers: dict[str, Path], urls: list[str], model: str, workdir: Path,
    policies: tuple[str, ...] = ("prefix",), interfaces: tuple[str, ...] | None = None,
) -> dict[str, tuple[str, str, int]]:  # fmt: skip
    """Start llmgw's gateway (one per policy and interface) and every installed peer in front of `urls`.

    name -> (URL, key, pid). The first interface's gateway (by default the first of
    BENCH_PEERS_INTERFACES, as scripts/gateway.sh serves it) is "llmgw" (or "llmgw <policy>"),
    another's "llmgw <interface>".
    """
    interfaces = interfaces or _interfaces()[:1]
    out: dict[str, tuple[str, str]] = {}
    pids: dict[str, int] = {}
    key = subprocess.run([sys.executable, "-c", _SETUP], cwd=ROOT, env=env, input=json.dumps({model: urls}),
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    for policy in policies:
        for interface in interfaces:
            port = _free_port()
            name = "llmgw" if policy == "prefix" else f"llmgw {policy}"
            name = name if interface == interfaces[0] else f"{name} {interface}"
            pids[name] = procs.start(["bash", "scripts/gateway.sh", f"127.0.0.1:{port}"],
                                     {**env, "LLMGW_GATEWAY_POLICY": policy, "LLMGW_GATEWAY_INTERFACE": interface},
                                     f"llmgw-{policy}-{interface}-{port}").pid  # fmt: skip
            out[name] = (f"http://127.0.0.1:{port}", key)
    if "vllm-router" in peers:
        out["vllm-router"] = (_start_vllm_router(procs, peers["vllm-router"], urls, workdir), key)
        pids["vllm-router"] = procs.procs[-1].pid
    if "litellm" in peers:
        master = f"sk-{secrets.token_hex(16)}"
        out["litellm"] = (_start_litellm(procs, peers["litellm"], urls, workdir, model, master), master)
        pids["litellm"] = procs.procs[-1].pid
    ready: dict[str, tuple[str, str, int]] = {}
    for name, (url, k) in out.items():
        try:
            _wait(_answers(url, k, model), timeout=180)
            ready[name] = (url, k, pids[name])
        except RuntimeError:
            print(f"   {name}: did not answer a request within 180 s; left out of this run", flush=True)
    return ready


def _interfaces() -> tuple[str, ...]:
    """The ways of serving llmgw's gateway to measure, the one scripts/gateway.sh uses by default first."""
    return tuple(os.environ.get("BENCH_PEERS_INTERFACES", "native,asgi").split(","))


def _answers(url: str, key: str, model: str) -> Callable[[], bool]:
    def probe() -> bool:
        body = {"model": model, "messages": [{"role": "user", "content": "ready"}], "max_tokens": 1}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=5)
        return r.status_code == 200

    return probe


async def _closed(url: str, key: str, model: str, clients: int, seconds: float) -> tuple[float, int]:
    """`clients` streamed requests back to back for `seconds`: answers completed a second, and the errors."""
    body = {"model": model, "messages": [{"role": "user", "content": "one two three four five"}], "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    done = errors = 0
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:

        async def loop() -> None:
            nonlocal done, errors
            while time.perf_counter() < end:
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and r.content.rstrip().endswith(b"[DONE]")
                    if not ok:
                        FAILURES[failure(r)] += 1
                except httpx.HTTPError as e:
                    ok = False
                    FAILURES[failure(None, e)] += 1
                done += ok
                errors += not ok

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
    return done / (time.perf_counter() - started), errors


def _bounded(coro: Coroutine[Any, Any, tuple], limit: float, failed: tuple) -> tuple:
    """Run `coro` for at most `limit` seconds; `failed` (everything counted as failed) if it runs over.

    A front that falls far behind (LiteLLM's proxy at hundreds of requests a
    second) would otherwise keep a phase waiting on its backlog for many minutes.
    """

    async def wrapped() -> tuple:
        try:
            return await asyncio.wait_for(coro, limit)
        except TimeoutError:
            return failed

    return asyncio.run(wrapped())


def _overhead(env: dict[str, str], procs: Procs, peers: dict[str, Path], workdir: Path) -> dict[str, list[float]]:
    rate = float(os.environ.get("BENCH_PEERS_RATE", 500))
    seconds = float(os.environ.get("BENCH_PEERS_SECONDS", 3))
    echo = procs.echo(env, "bench", "--token-seconds", "0", "--prefill-tokens-per-s", "0", "--max-batch", "0")
    # The gateway over granian's ASGI interface (as scripts/gateway.sh serves it) and, beside it, over RSGI.
    fronts = _fronts(env, procs, peers, [echo], "bench", workdir, interfaces=_interfaces())
    out: dict[str, list[float]] = {}
    for stream in (False, True):
        kind = "streamed" if stream else "not streamed"
        for name, (url, key, pid) in fronts.items():
            _bounded(_steady(url, key, "bench", 100, 1, stream), 30, ([], 0))  # warm the pools
            offered = ([], int(rate * seconds))
            direct, e1 = _bounded(_steady(echo, key, "bench", rate, seconds, stream), seconds + 30, offered)
            cpu = cpu_seconds(pid)
            through, e2 = _bounded(_steady(url, key, "bench", rate, seconds, stream), seconds + 30, offered)
            cpu = cpu_seconds(pid) - cpu
            if through:
                out[f"{name}: CPU ms per request, {kind}, {rate:g}/s offered"] = [cpu * 1000 / len(through)]
            out[f"{name}: added p50 ms, {kind}"] = [(_pct(through, 50) - _pct(direct, 50)) * 1000]
            out[f"{name}: added p99 ms, {kind}"] = [(_pct(through, 99) - _pct(direct, 99)) * 1000]
            out[f"{name}: errors, {kind}"] = [float(e2)]
            out[f"direct: errors, {kind}"] = out.get(f"direct: errors, {kind}", [0.0])
            out[f"direct: errors, {kind}"][0] += e1
            _note(f"{name} and direct, {kind} at {rate:g}/s")
    for name, (url, key, _pid) in fronts.items():
        held = 0.0
        for step in STEPS:
            lat, errors = _bounded(_steady(url, key, "bench", step, min(seconds, 3), True), seconds + 30, ([], 1))
            if errors or _pct(lat, 99) > 0.050:
                break
            held = float(step)
        _note(f"{name}, stepping up streamed")
        out[f"{name}: highest streamed rate with p99 < 50 ms, req/s"] = [held]
        clients = int(os.environ.get("BENCH_PEERS_CLIENTS", 64))
        rate_done, errors = _bounded(_closed(url, key, "bench", clients, seconds), seconds + 60, (0.0, clients))
        out[f"{name}: throughput, {clients} clients streaming back to back, req/s"] = [rate_done]
        out[f"{name}: errors, back to back"] = [float(errors)]
        _note(f"{name}, back to back")
    procs.stop()
    return out


def _routing(
    env: dict[str, str], procs: Procs, peers: dict[str, Path], w: Workload, seed: int, workdir: Path
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    names = ["llmgw", "llmgw round-robin", *peers]
    if "vllm-router" in peers:
        names.insert(names.index("vllm-router") + 1, NO_TOKENIZER)
    for label in names:
        name = "vllm-router" if label == NO_TOKENIZER else label
        # Fresh replicas for each front, so that no front finds another's cache.
        flags = ("--no-tokenizer",) if label == NO_TOKENIZER else ()
        urls = [procs.echo(env, "chat", "--cache-blocks", str(w.cache_blocks), *flags) for _ in range(4)]
        wanted = {k: v for k, v in peers.items() if k == name}
        policy = "round-robin" if name == "llmgw round-robin" else "prefix"
        fronts = _fronts(env, procs, wanted, urls, "chat", workdir, (policy,) if name.startswith("llmgw") else ())
        if name not in fronts:
            procs.stop()
            continue
        url, key, pid = fronts[name]
        name = label
        h0, q0 = _cache_counters(urls)  # the readiness probes' own lookups are not the workload's
        s0 = _served(urls)
        cpu = cpu_seconds(pid)
        ttft, errors = asyncio.run(_conversations(url, key, w, seed))
        cpu = cpu_seconds(pid) - cpu
        hits, queries = _cache_counters(urls)
        hits, queries = hits - h0, queries - q0
        shares = sorted((b - a for a, b in zip(s0, _served(urls), strict=True)), reverse=True)
        out[f"{w.name}, {name}: prefix-cache hit ratio"] = [hits / queries if queries else 0.0]
        SHARES.setdefault(f"{w.name}, {name}", []).append(shares)
        if ttft:
            out[f"{w.name}, {name}: CPU ms per request"] = [cpu * 1000 / len(ttft)]
        out[f"{w.name}, {name}: mean time to first token ms"] = [
            statistics.fmean(ttft) * 1000 if ttft else float("nan")
        ]
        out[f"{w.name}, {name}: errors"] = [float(errors)]
        _note(f"{w.name}, {name}")
        procs.stop()
    out[f"{w.name}, ceiling (one replica, unbounded cache): prefix-cache hit ratio"] = [ceiling(w, seed)]
    return out


# The label of vLLM's router in front of replicas without vLLM's tokenizer routes.
NO_TOKENIZER = "vllm-router (no tokenizer API)"
# Each routing run's requests per replica, busiest first, by workload and front.
SHARES: dict[str, list[list[float]]] = {}


def _served(urls: list[str]) -> list[float]:
    """Each replica's requests answered so far (vLLM's request_success_total)."""
    out = []
    for u in urls:
        n = 0.0
        for line in httpx.get(f"{u}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:request_success_total"):
                n = float(line.split()[-1])
        out.append(n)
    return out


def _ratios(figures: dict[str, list[float]], peers: list[str]) -> list[str]:
    """llmgw's figures over each peer's, run by run (median of the per-run ratios)."""
    lines = []
    for peer in peers:
        for k, v in figures.items():
            if not k.startswith(f"{peer}: ") and f", {peer}: " not in k:
                continue
            mine = figures.get(k.replace(peer, "llmgw", 1))
            if not mine or "errors" in k:
                continue
            pairs = [m / p for m, p in zip(mine, v, strict=False) if p]
            if pairs:
                what = k.replace(f"{peer}: ", "").replace(f", {peer}", "")
                lines.append(f"ratio llmgw / {peer}, {what}: median {statistics.median(pairs):.2f}")
    return lines


# Each failed request, by phase and what it came to (status and body, or exception), for the report.
NOTES: list[str] = []


def _note(phase: str) -> None:
    lines = failures_report(phase)
    for line in lines:
        print(f"   failed: {line}", flush=True)
    NOTES.extend(lines)


def _keep(loads: list[float], figures: dict[str, list[float]]) -> None:
    # What the parts so far measured, kept should a later one not finish.
    (PEERS_DIR / "figures.json").write_text(json.dumps({"load": loads, "figures": figures}, indent=1))


def run() -> list[str]:
    """Install the peers, then every part BENCH_PEERS_RUNS times; min / median / max and the ratios."""
    runs = int(os.environ.get("BENCH_PEERS_RUNS", 3))
    parts = os.environ.get("BENCH_PEERS_PARTS", "overhead,routing").split(",")
    workloads = [WORKLOADS[n] for n in os.environ.get("BENCH_PEERS_WORKLOADS", "short,sessions,long,shared").split(",")]
    lines: list[str] = []
    peers: dict[str, Path] = {}
    # BENCH_PEERS=none (or empty): llmgw alone.
    for name in filter(None, os.environ.get("BENCH_PEERS", ",".join(PEERS)).replace("none", "").split(",")):
        exe, why = install(name)
        lines.append(f"{name}: {why}")
        if exe is not None:
            peers[name] = exe
    env = _env()
    _recreate_database(env["DATABASE_URL"])
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    figures: dict[str, list[float]] = {}
    loads: list[float] = []
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="llmgw-peers-") as tmp:
        try:
            for i in range(runs):
                loads.append(os.getloadavg()[0])
                if "overhead" in parts:
                    for k, v in _overhead(env, procs, peers, Path(tmp)).items():
                        figures.setdefault(k, []).extend(v)
                    _keep(loads, figures)
                for w in workloads if "routing" in parts else ():
                    for k, v in _routing(env, procs, peers, w, i, Path(tmp)).items():
                        figures.setdefault(k, []).extend(v)
                    _keep(loads, figures)
        finally:
            procs.stop()
    lines.append(f"{runs} runs; load average (1 min) at each run's start: {', '.join(f'{x:.2f}' for x in loads)}")
    for k, v in figures.items():
        lines.append(f"{k}: min {min(v):.3f} / median {statistics.median(v):.3f} / max {max(v):.3f}")
    for k, runs_shares in SHARES.items():
        by_run = " | ".join("/".join(f"{x:.0f}" for x in r) for r in runs_shares)
        lines.append(f"{k}: requests per replica, busiest first, by run: {by_run}")
    lines.extend(_ratios(figures, list(peers)))
    lines.extend(f"failed: {n}" for n in NOTES)
    lines.append(f"every process's output: {LOGS}")
    return lines
