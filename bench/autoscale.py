"""Autoscaling: replicas that follow a load ramping 0 -> peak -> 0, scale to zero, and the cold start.

Creates a database of its own (<configured name>_bench_autoscale), registers
BENCH_AS_NODES simulated 8-GPU nodes and one autoscaled deployment of
single-GPU echo replicas (minimum 0, maximum BENCH_AS_MAX, BENCH_AS_TARGET
requests in flight per replica, scale-down window BENCH_AS_DOWN_S), and starts
a gateway data plane (scripts/gateway.sh) as a process of its own. This
process plays beat (a reconcile pass every second) and the node agents: each
StartShard starts an echo engine process on the shard's port (prefill
BENCH_AS_PREFILL tokens/s, a token every BENCH_AS_TOKEN_S s, at most
BENCH_AS_BATCH requests at once, BENCH_AS_LOAD_S s of loading before it is
healthy), reported ready once it answers; each StopShard stops it.

The load: streamed chats of 200 fresh words (no prefix-cache hits), 32
tokens out, arriving at a rate ramping linearly from 0 to BENCH_AS_PEAK
requests/s over a third of BENCH_AS_SECONDS, held for a third, down to 0
over the last third; then idle until the deployment is back at zero.

Reports: replicas (ready) against load every BENCH_AS_STEP_S seconds; the
share of those intervals whose TTFT p95 held BENCH_AS_TTFT s; failed
requests; the cold start of the first request (placement, engine start,
first token); GPU-hours used (a GPU per live engine) against a fixed
deployment sized for the peak over the same time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

from bench.gateway import Procs, _pct, _wait


def _f(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


SECONDS = _f("BENCH_AS_SECONDS", 180)
PEAK = _f("BENCH_AS_PEAK", 12)
TARGET = _f("BENCH_AS_TARGET", 4)
MAX = int(_f("BENCH_AS_MAX", 6))
DOWN_S = int(_f("BENCH_AS_DOWN_S", 30))
TTFT = _f("BENCH_AS_TTFT", 1.0)
STEP_S = _f("BENCH_AS_STEP_S", 10)
NODES = int(_f("BENCH_AS_NODES", 1))
PREFILL = _f("BENCH_AS_PREFILL", 2000)
TOKEN_S = _f("BENCH_AS_TOKEN_S", 0.02)
BATCH = int(_f("BENCH_AS_BATCH", 4))
LOAD_S = _f("BENCH_AS_LOAD_S", 5)
WORDS = [f"w{i}" for i in range(5000)]


@dataclass
class Sent:
    """One request: when it was sent, its time to first token and whether it failed (and how)."""

    at: float
    ttft: float | None = None
    failed: str = ""
    done: float = float("inf")


@dataclass
class World:
    """What the agent side saw, shared with the load side."""

    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    # (monotonic time, engines live, replicas ready) every agent tick.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    placed_at: float | None = None
    healthy_at: float | None = None
    ready_at: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    error: str = ""


def _db_url(name: str) -> str:
    parts = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw"))
    return urlunsplit(parts._replace(path=f"/{name}"))


def _echo_argv(port: int) -> list[str]:
    return [
        sys.executable, "-m", "llmgw_sim.echo", "--port", str(port), "--served-model-name", "chat",
        "--prefill-tokens-per-s", str(PREFILL), "--token-seconds", str(TOKEN_S), "--max-batch", str(BATCH),
        "--load-seconds", str(LOAD_S),
    ]  # fmt: skip


def _agent(world: World, procs: Procs, env: dict[str, str]) -> None:
    """Beat and the node agents, until stopped: reconcile each second, start and stop echo engines."""
    from django.db import close_old_connections
    from django.utils import timezone

    import llmgw_wire as wire
    from inventory.heartbeat import touch
    from inventory.models import Command
    from placement import agent_sync
    from placement.models import Replica, Shard
    from placement.reconciler import reconcile

    def report(shard: Shard, state: str) -> None:
        status = wire.ShardStatus(shard_id=str(shard.id), replica_id=str(shard.replica_id), state=state)
        agent_sync.record_shard_states(shard.node_id, [status], now=timezone.now())

    starting: dict[str, Shard] = {}
    last_pass = 0.0
    try:
        while not world.stop.is_set():
            now = timezone.now()
            for i in range(NODES):
                touch(f"sim-{i}", now=now)
            if time.monotonic() - last_pass >= 1.0:
                reconcile(now=now)
                last_pass = time.monotonic()
            for cmd in Command.objects.filter(acked_at__isnull=True).order_by("id"):
                sid = cmd.payload["shard_id"]
                shard = Shard.objects.filter(id=sid).first()
                if cmd.kind == "start_shard" and shard is not None:
                    world.placed_at = world.placed_at or time.monotonic()
                    world.engines[sid] = procs.start(_echo_argv(shard.http_port), env, f"echo-{shard.http_port}")
                    starting[sid] = shard
                    report(shard, "loading")
                elif cmd.kind == "stop_shard":
                    p = world.engines.pop(sid, None)
                    if p is not None:
                        p.terminate()
                        p.wait(timeout=10)
                    starting.pop(sid, None)
                    if shard is not None:
                        report(shard, "stopped")
                Command.objects.filter(id=cmd.id).update(acked_at=now)
            for sid, shard in list(starting.items()):
                try:
                    up = httpx.get(f"http://127.0.0.1:{shard.http_port}/health", timeout=0.5).status_code == 200
                except httpx.HTTPError:
                    up = False
                if up:
                    world.healthy_at = world.healthy_at or time.monotonic()
                    report(shard, "ready")
                    del starting[sid]
                    reconcile(now=timezone.now())
                    world.ready_at = world.ready_at or time.monotonic()
            ready = Replica.objects.filter(state="ready").count()
            world.timeline.append((time.monotonic(), len(world.engines), ready))
            close_old_connections()
            time.sleep(0.25)
    except Exception as e:  # the bench says what broke instead of hanging
        world.error = f"{type(e).__name__}: {e}"
        raise


def _rate(t: float) -> float:
    third = SECONDS / 3
    if t < third:
        return PEAK * t / third
    if t < 2 * third:
        return PEAK
    return max(0.0, PEAK * (SECONDS - t) / third)


async def _load(url: str, key: str, start: float) -> list[Sent]:
    """Poisson arrivals at the ramping rate for SECONDS; every request's outcome."""
    rng = random.Random(7)
    sent: list[Sent] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:

        async def one(s: Sent) -> None:
            words = " ".join(rng.choice(WORDS) for _ in range(200))
            body = {"model": "chat", "stream": True, "max_tokens": 32, "messages": [{"role": "user", "content": words}]}
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        s.failed = f"HTTP {r.status_code}: {(await r.aread())[:120]!r}"
                        return
                    tail = b""
                    async for chunk in r.aiter_bytes():
                        if s.ttft is None and b'"content"' in chunk:
                            s.ttft = time.monotonic() - s.at
                        tail = (tail + chunk)[-64:]
                    if not tail.rstrip().endswith(b"[DONE]"):
                        s.failed = "stream cut"
            except httpx.HTTPError as e:
                s.failed = f"{type(e).__name__}: {e}"
            finally:
                s.done = time.monotonic()

        tasks = []
        t = 0.0
        # The first request arrives at once: the cold start from zero.
        while t < SECONDS:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            s = Sent(time.monotonic())
            sent.append(s)
            tasks.append(asyncio.create_task(one(s)))
            t += rng.expovariate(max(_rate(t), PEAK / 50))
        await asyncio.gather(*tasks)
    return sent


def run() -> list[str]:
    os.environ.setdefault("LLMGW_SHARD_PORT_BASE", str(random.randint(30000, 50000)))
    import django

    django.setup()
    # The steps are reported below; each one's log line would bury the figures.
    logging.getLogger("placement").setLevel(logging.WARNING)
    logging.getLogger("inventory").setLevel(logging.WARNING)
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    import llmgw_wire as wire
    from bench.common import scratch_database
    from bench.heartbeat import register_payload
    from gateway import keys
    from inventory.nodes import upsert_node
    from placement import kept
    from placement.models import AutoscaleSample, Deployment, EngineProfile, PlacementEvent

    kept.reset()
    lines: list[str] = []
    with scratch_database("bench_autoscale"):
        now = timezone.now()
        for i in range(NODES):
            p = register_payload(f"sim-{i}")
            p.update(mgmt_addr="127.0.0.1", engines_probed=False, engine_versions={}, fabrics=[])
            upsert_node(wire.Register.model_validate(p), now=now)
        prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
        dep = Deployment.objects.create(
            name="chat", served_model="chat", profile=prof, replicas=0, autoscale_metric="inflight",
            autoscale_min=0, autoscale_max=MAX, autoscale_target=TARGET, scale_down_window_s=DOWN_S,
        )  # fmt: skip
        user = get_user_model().objects.create_user("bench")
        _, key = keys.create_key(name="bench", owner=user, now=now)
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="llmgw.settings", DATABASE_URL=_db_url(connection.settings_dict["NAME"]),
            SECRET_KEY="bench-autoscale", DEBUG="0", CELERY_BROKER_URL="memory://", LOG_LEVEL="WARNING",
            LLMGW_CACHE_PREFIX=settings.LLMGW_CACHE_PREFIX, LLMGW_GATEWAY_REFRESH="1",
            LLMGW_WEB_LOG_LEVEL="warning", PYTHON=sys.executable, LLMGW_GATEWAY_HOLD_TIMEOUT="120",
        )  # fmt: skip
        procs = Procs()
        world = World()
        agent = threading.Thread(target=_agent, args=(world, procs, env), daemon=True)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs.start(["bash", "scripts/gateway.sh", f"127.0.0.1:{port}"], env, "gateway")
            url = f"http://127.0.0.1:{port}"
            _wait(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200)
            agent.start()
            start = time.monotonic()
            sent = asyncio.run(_load(url, key, start))
            load_end = time.monotonic()
            # Idle until the deployment is back at zero (the scale-down window and a drain).
            deadline = time.monotonic() + DOWN_S + 120
            while time.monotonic() < deadline and (world.engines or not world.timeline):
                if world.error:
                    break
                time.sleep(1)
            end = time.monotonic()
        finally:
            world.stop.set()
            agent.join(timeout=30)
            procs.stop()
            for p in world.engines.values():
                p.kill()
        steps = list(PlacementEvent.objects.filter(kind="autoscaled").order_by("at").values_list("reason", flat=True))
        samples = AutoscaleSample.objects.filter(deployment=dep).count()
    if world.error:
        lines.append(f"the agent's loop failed: {world.error}")
    first = sent[0]
    failed = [s for s in sent if s.failed]
    lines.append(
        f"load: {len(sent)} streamed requests over {SECONDS:g} s, 0 -> {PEAK:g}/s -> 0; policy inflight "
        f"target {TARGET:g}/replica, 0..{MAX} replicas, scale-down window {DOWN_S} s; echo prefill {PREFILL:g} tok/s, "
        f"{TOKEN_S * 1000:g} ms/token, batch {BATCH}, {LOAD_S:g} s loading"
    )
    lines.append("   t (s)  offered/s  in flight  replicas ready  engines  TTFT p95 (s)")
    held_ok = counted = 0
    t = 0.0
    while t < end - start:
        window = [s for s in sent if start + t <= s.at < start + t + STEP_S]
        ttfts = [s.ttft for s in window if s.ttft is not None]
        p95 = _pct(ttfts, 95) if ttfts else None
        mid = start + t + STEP_S / 2
        inflight = sum(1 for s in sent if s.at <= mid < s.done)
        ticks = [x for x in world.timeline if start + t <= x[0] < start + t + STEP_S]
        ready = max((x[2] for x in ticks), default=0)
        engines = max((x[1] for x in ticks), default=0)
        if ttfts:
            counted += 1
            held_ok += p95 <= TTFT
        lines.append(
            f"   {t:5.0f}  {_rate(t + STEP_S / 2) if t < SECONDS else 0:9.1f}  {inflight:9d}  {ready:14d}  "
            f"{engines:7d}  {'-' if p95 is None else f'{p95:.2f}':>12}"
        )
        t += STEP_S
    lines.append(
        f"TTFT p95 <= {TTFT:g} s in {held_ok} of {counted} intervals with requests ({held_ok / max(1, counted):.0%})"
    )
    lines.append(f"failed requests: {len(failed)} of {len(sent)}" + (f" (first: {failed[0].failed})" if failed else ""))
    if world.placed_at and world.healthy_at and first.ttft is not None:
        lines.append(
            f"cold start of the first request: {first.ttft:.2f} s = placement {world.placed_at - first.at:.2f} s"
            f" + engine start {world.healthy_at - world.placed_at:.2f} s"
            f" + to first token {first.at + first.ttft - world.healthy_at:.2f} s"
        )
    gpu_s = 0.0
    for (t0, n, _), (t1, _, _) in zip(world.timeline, world.timeline[1:], strict=False):
        gpu_s += n * (t1 - t0)
    peak_engines = max((n for _, n, _ in world.timeline), default=0)
    span = world.timeline[-1][0] - world.timeline[0][0] if world.timeline else 0.0
    fixed = peak_engines * span
    lines.append(
        f"GPU-hours: {gpu_s / 3600:.3f} autoscaled vs {fixed / 3600:.3f} for {peak_engines} fixed replicas "
        f"over the same {span:.0f} s ({gpu_s / max(fixed, 1e-9):.0%}); back at zero "
        + (f"{end - load_end:.0f} s after the load ended" if not world.engines else "not reached")
    )
    lines.append(f"{len(steps)} scaling steps, {samples} passes recorded; steps: " + " | ".join(steps[:12]))
    return lines
