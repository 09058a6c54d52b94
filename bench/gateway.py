"""The gateway: its overhead, and the routing quality of its prefix policy against round-robin.

Creates a database of its own (<configured name>_gateway), starts echo
replicas and a gateway data plane (scripts/gateway.sh, as `make run` does)
as processes of their own, and drives them from this process.

1. Overhead: the same requests straight to one echo replica and through the
   gateway, streamed and not, at a steady offered rate (BENCH_GW_RATE,
   default 100/s) for BENCH_GW_SECONDS (default 5): added latency p50/p99;
   then the highest offered rate (stepping up) the gateway holds with p99
   under 50 ms and no errors.
2. Routing quality: multi-turn chat workloads (WORKLOADS, chosen with
   BENCH_GW_WORKLOADS, default all three) over 4 echo replicas with the small-GPU
   defaults: prefix-cache hit ratio (the replicas' own counters) and mean
   time to first token, round-robin against the prefix policy.
Each part runs BENCH_GW_RUNS times (default 3) and prints min/median/max.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from bench.heartbeat import _free_port, _recreate_database
from llmgw_sim.echo import PrefixCache, _context_tokens

ROOT = Path(__file__).resolve().parents[1]

_SETUP = """
import json, sys
import django
django.setup()
from django.contrib.auth import get_user_model
from django.utils import timezone
from gateway import keys
from placement.models import Deployment, EngineProfile, Replica
spec = json.load(sys.stdin)
now = timezone.now()
user, _ = get_user_model().objects.get_or_create(username="bench")
Replica.objects.all().delete()
Deployment.objects.all().delete()
EngineProfile.objects.all().delete()
for model, endpoints in spec.items():
    p = EngineProfile.objects.create(name="echo-" + model, engine="echo")
    d = Deployment.objects.create(name=model, served_model=model, profile=p, replicas=len(endpoints))
    for e in endpoints:
        Replica.objects.create(deployment=d, state="ready", endpoint=e, created_at=now, updated_at=now)
print(keys.create_key(name="bench", owner=user, now=now)[1])
"""


def _env() -> dict[str, str]:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "llmgw"
    db_url = urlunsplit(parts._replace(path=f"/{name}_gateway"))
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DATABASE_URL": db_url,
            "SECRET_KEY": "bench-gateway",
            "DEBUG": "0",
            "CELERY_BROKER_URL": "memory://",
            "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw") + "-bench-gw",
            "LOG_LEVEL": "WARNING",
            "LLMGW_WEB_LOG_LEVEL": "warning",
            "PYTHON": sys.executable,
        }
    )
    return env


# Every process the benchmarks start writes its output here (BENCH_LOGS), one file each,
# so that a failed request can be read in the log of the front or replica that failed it.
LOGS = Path(os.environ.get("BENCH_LOGS", str(ROOT / "var" / "bench-logs")))


class Procs:
    """The processes the benchmark starts, stopped together; their output kept under LOGS."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        LOGS.mkdir(parents=True, exist_ok=True)

    def start(self, argv: list[str], env: dict[str, str], name: str = "") -> subprocess.Popen:
        name = name or Path(argv[0]).name
        log = open(LOGS / f"{time.strftime('%H%M%S')}-{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        with log:
            p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def echo(self, env: dict[str, str], model: str, *flags: str) -> str:
        port = _free_port()
        self.start([sys.executable, "-m", "llmgw_sim.echo", "--port", str(port), "--served-model-name", model,
                    *flags], env, f"echo-{port}")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200)
        return url

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()


def _wait(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("not up in time")


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def failure(response: httpx.Response | None, error: BaseException | None = None) -> str:
    """What a failed request came to, in a line: its status and body's start, or the exception."""
    if response is not None:
        return f"HTTP {response.status_code}: {response.content[:160].decode('utf-8', 'replace')}"
    return f"{type(error).__name__}: {str(error)[:160]}"


# Every failed request of a run, by what it came to (printed by the benchmarks, then cleared).
FAILURES: Counter[str] = Counter()


def failures_report(what: str) -> list[str]:
    """The failed requests recorded since the last report, most frequent first, as lines; clears them."""
    lines = [f"{what}: {n} x {desc}" for desc, n in FAILURES.most_common(8)]
    FAILURES.clear()
    return lines


async def _steady(url: str, key: str, model: str, rate: float, seconds: float, stream: bool) -> tuple[list[float], int]:
    """Offer `rate` requests a second for `seconds`; each request's latency (to its last byte) and the errors."""
    body = {"model": model, "messages": [{"role": "user", "content": "one two three four five six seven eight"}]}
    if stream:
        body["stream"] = True
    data = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=10) as client:

        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/chat/completions", content=data)
                if r.status_code != 200 or (stream and not r.content.rstrip().endswith(b"[DONE]")):
                    errors += 1
                    FAILURES[failure(r)] += 1
                    return
            except httpx.HTTPError as e:
                errors += 1
                FAILURES[failure(None, e)] += 1
                return
            lat.append(time.perf_counter() - t0)

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return lat, errors


def _overhead(env: dict[str, str], procs: Procs) -> dict[str, list[float]]:
    seconds = float(os.environ.get("BENCH_GW_SECONDS", 5))
    rate = float(os.environ.get("BENCH_GW_RATE", 100))
    echo = procs.echo(env, "bench", "--token-seconds", "0", "--prefill-tokens-per-s", "0", "--max-batch", "0")
    key = subprocess.run([sys.executable, "-c", _SETUP], cwd=ROOT, env=env, input=json.dumps({"bench": [echo]}),
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    port = _free_port()
    procs.start(["bash", "scripts/gateway.sh", f"127.0.0.1:{port}"], env)
    gw = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(f"{gw}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=1).json()["data"])
    out: dict[str, list[float]] = {}
    for stream in (False, True):
        kind = "stream" if stream else "plain"
        asyncio.run(_steady(gw, key, "bench", 100, 1, stream))  # warm the pools
        direct, e1 = asyncio.run(_steady(echo, key, "bench", rate, seconds, stream))
        through, e2 = asyncio.run(_steady(gw, key, "bench", rate, seconds, stream))
        out[f"{kind} direct p50 ms"] = [_pct(direct, 50) * 1000]
        out[f"{kind} direct p99 ms"] = [_pct(direct, 99) * 1000]
        out[f"{kind} added p50 ms"] = [(_pct(through, 50) - _pct(direct, 50)) * 1000]
        out[f"{kind} added p99 ms"] = [(_pct(through, 99) - _pct(direct, 99)) * 1000]
        out[f"{kind} errors"] = [float(e1 + e2)]
    held = 0.0
    for step in (50, 100, 200, 300, 500, 750, 1000, 1500, 2000):
        lat, errors = asyncio.run(_steady(gw, key, "bench", step, min(seconds, 3), True))
        if errors or _pct(lat, 99) > 0.050:
            break
        held = float(step)
    out["highest streamed rate with p99 < 50 ms, req/s"] = [held]
    procs.stop()
    return out


@dataclass(frozen=True)
class Workload:
    """A multi-turn chat workload: conversations over a few shared system prompts, a few at a time.

    Words stand for tokens (the echo engine's tokenizer); its replies repeat the
    question, capped at `reply_words`.
    """

    name: str
    conversations: int
    turns: int
    systems: int
    system_words: tuple[int, int]
    question_words: tuple[int, int]
    reply_words: int
    concurrency: int
    cache_blocks: int


# The workload the router was first measured on: short chats behind long system
# prompts, which every replica soon caches whatever the router does.
SHORT_CHATS = Workload("short chats", 32, 4, 4, (200, 400), (20, 60), 32, 8, 256)
# Many concurrent sessions of 8 turns behind 8 shorter system prompts, more than
# one replica's prefix cache (the echo engine's small-GPU default, 2048 blocks
# of 16) holds: the case where a conversation goes decides whether its
# earlier turns are still cached.
SESSIONS = Workload("sessions", 192, 8, 8, (100, 300), (20, 60), 64, 32, 2048)
# Conversations whose own turns outweigh the shared prompt: six turns of long
# questions and answers behind short system prompts, as in a coding assistant
# or a document chat. Round-robin finds the system prompt and whatever part of
# the history the replica it picks last saw; following the conversation finds
# all of it but the newest turn.
LONG_CHATS = Workload("long chats", 64, 6, 4, (20, 40), (80, 120), 120, 16, 2048)
WORKLOADS = {"short": SHORT_CHATS, "sessions": SESSIONS, "long": LONG_CHATS}


async def _conversations(url: str, key: str, w: Workload, seed: int, model: str = "chat") -> tuple[list[float], int]:
    """Run the workload; each request's time to first token, and the errors."""
    rng = random.Random(seed)
    systems = [" ".join(f"sys{s}w{i}" for i in range(rng.randint(*w.system_words))) for s in range(w.systems)]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ttft: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(w.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:

        async def chat(c: int) -> None:
            nonlocal errors
            messages = [{"role": "system", "content": systems[c % w.systems]}]
            for t in range(w.turns):
                question = " ".join(f"c{c}t{t}q{i}" for i in range(rng.randint(*w.question_words)))
                messages.append({"role": "user", "content": question})
                body = {"model": model, "messages": messages, "stream": True, "max_tokens": w.reply_words}
                async with sem:
                    t0 = time.perf_counter()
                    first = None
                    answer = []
                    try:
                        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                if not line.startswith("data: {"):
                                    continue
                                chunk = json.loads(line[6:])
                                for ch in chunk.get("choices", []):
                                    piece = ch.get("delta", {}).get("content")
                                    if piece:
                                        first = first or time.perf_counter()
                                        answer.append(piece)
                        if r.status_code != 200 or first is None:
                            errors += 1
                            return
                    except httpx.HTTPError:
                        errors += 1
                        return
                ttft.append(first - t0)
                messages.append({"role": "assistant", "content": "".join(answer)})

        await asyncio.gather(*(chat(c) for c in range(w.conversations)))
    return ttft, errors


def ceiling(w: Workload, seed: int) -> float:
    """The hit ratio no router can beat on `w`: every request of it on one replica with an unbounded cache.

    The same prompts as `_conversations` sends (the echo engine's replies are
    its questions, capped), looked up in the echo engine's own prefix cache.
    """
    rng = random.Random(seed)
    systems = [" ".join(f"sys{s}w{i}" for i in range(rng.randint(*w.system_words))) for s in range(w.systems)]
    cache = PrefixCache(16, 1 << 62)
    for c in range(w.conversations):
        messages = [{"role": "system", "content": systems[c % w.systems]}]
        for t in range(w.turns):
            question = " ".join(f"c{c}t{t}q{i}" for i in range(rng.randint(*w.question_words)))
            messages.append({"role": "user", "content": question})
            cache.admit(_context_tokens({"messages": messages}, chat=True))
            messages.append({"role": "assistant", "content": " ".join(question.split()[: w.reply_words])})
    return cache.hits / cache.queries if cache.queries else 0.0


def _cache_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(f"{u}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def _routing(env: dict[str, str], procs: Procs, w: Workload, seed: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for policy in ("round-robin", "prefix"):
        urls = [procs.echo(env, "chat", "--cache-blocks", str(w.cache_blocks)) for _ in range(4)]
        key = subprocess.run([sys.executable, "-c", _SETUP], cwd=ROOT, env=env, input=json.dumps({"chat": urls}),
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        port = _free_port()
        procs.start(["bash", "scripts/gateway.sh", f"127.0.0.1:{port}"], {**env, "LLMGW_GATEWAY_POLICY": policy})
        gw = f"http://127.0.0.1:{port}"
        _wait(lambda gw=gw, key=key: httpx.get(f"{gw}/v1/models", headers={"Authorization": f"Bearer {key}"},
                                                timeout=1).json()["data"][0]["ready_replicas"] == 4)  # fmt: skip
        ttft, errors = asyncio.run(_conversations(gw, key, w, seed))
        hits, queries = _cache_counters(urls)
        out[f"{w.name}, {policy}: prefix-cache hit ratio"] = [hits / queries if queries else 0.0]
        out[f"{w.name}, {policy}: mean time to first token ms"] = [
            statistics.fmean(ttft) * 1000 if ttft else float("nan")
        ]
        out[f"{w.name}, {policy}: errors"] = [float(errors)]
        procs.stop()
    rr, px = (
        out[f"{w.name}, round-robin: prefix-cache hit ratio"][0],
        out[f"{w.name}, prefix: prefix-cache hit ratio"][0],
    )
    out[f"{w.name}: hit ratio, prefix / round-robin"] = [px / rr if rr else float("inf")]
    best = ceiling(w, seed)
    out[f"{w.name}: ceiling (one replica, unbounded cache)"] = [best]
    out[f"{w.name}: ceiling / round-robin, the most any router could gain"] = [best / rr if rr else float("inf")]
    return out


def _merge(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for k, v in more.items():
        into.setdefault(k, []).extend(v)


def run() -> list[str]:
    """Every part BENCH_GW_RUNS times; min / median / max of each figure."""
    runs = int(os.environ.get("BENCH_GW_RUNS", 3))
    parts = os.environ.get("BENCH_GW_PARTS", "overhead,routing").split(",")
    env = _env()
    _recreate_database(env["DATABASE_URL"])
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    figures: dict[str, list[float]] = {}
    procs = Procs()
    try:
        for i in range(runs):
            if "overhead" in parts:
                _merge(figures, _overhead(env, procs))
            if "routing" in parts:
                for name in os.environ.get("BENCH_GW_WORKLOADS", "short,sessions,long").split(","):
                    _merge(figures, _routing(env, procs, WORKLOADS[name], seed=i))
    finally:
        procs.stop()
    lines = [f"{runs} runs; load average before: {os.getloadavg()[0]:.2f}"]
    for k, v in figures.items():
        lines.append(f"{k}: min {min(v):.3f} / median {statistics.median(v):.3f} / max {max(v):.3f}")
    lines.extend(f"failed: {line}" for line in failures_report("all runs"))
    lines.append(f"every process's output: {LOGS}")
    return lines
