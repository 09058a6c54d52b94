"""A real engine in the whole loop: llama.cpp's llama-server, built from source, serving a tiny model.

Three simulated CPU nodes (recorded hardware, real node agents stepped by the
test) whose engines are probed for real: each finds the llama-server that
`make llama-server` built, by its version on stderr. A llama.cpp deployment is
placed by the planner, started by the agents with the flags they build, and
served through a real gateway to OpenAI's own SDK. A drain under streaming
load fails no request; a killed engine fails its shard with the engine's own
last lines, and the replica is rebuilt. Nothing here is the echo engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from django.utils import timezone

from inventory.models import Command, Node, NodeEvent
from inventory.nodes import change_state
from llmgw_agent import config as config_mod
from llmgw_agent.loop import Agent, DiscoveryProbe
from llmgw_sim.simulate import prepare_node
from llmgw_wire import engines as wire_engines
from placement.models import Deployment, EngineProfile, Replica, Shard
from placement.reconciler import reconcile
from tests.gateway.conftest import Load, gateway_factory, make_key  # noqa: F401
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

JOIN = "e2e-join-token-for-the-real-engine"
MODEL = "tiny"
# Long enough that a shared prefix is worth caching: llama.cpp reuses a slot's cached prompt.
SYSTEM = "You are a careful assistant for the operators of a GPU cluster. " * 6
# Random weights may pick the end-of-turn token at once: exact counts need llama.cpp's own switch. Sampled,
# eight tokens of a byte-level vocabulary were now and then only pieces of characters, streamed as no text at
# all: greedy decoding of the seeded weights answers the same text every run.
NOISE = {"ignore_eos": True, "temperature": 0}


class Cluster:
    """Simulated CPU nodes whose agents run real engines, stepped by the test."""

    def __init__(self, url: str, workdir: Path, n: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        token = workdir / "join-token"
        token.write_text(JOIN)
        self.agents: dict[str, Agent] = {}
        for i in range(n):
            node = prepare_node(
                index=i, profile="cpu-only", workdir=workdir, control_plane=url, token_file=token, heartbeat_interval=1
            )
            cfg = dataclasses.replace(config_mod.load(str(node.config)), root=str(node.root), engines_live=True)
            probe = DiscoveryProbe(root=cfg.root, model_dirs=list(cfg.model_dirs), engines_live=True)
            self.agents[node.node_id] = Agent(cfg, probe=probe)

    def step(self) -> None:
        reconcile(now=timezone.now())
        for a in self.agents.values():
            a.step()

    def until(self, cond, *, timeout: float = 60.0, what=None):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            got = cond()
            if got:
                return got
            time.sleep(0.05)
        pytest.fail(f"not reached in {timeout}s: {what() if what else summary()}")

    def pids(self) -> dict[str, int]:
        return {sid: pid for a in self.agents.values() for sid, pid in a.supervisor.pids().items()}

    def close(self) -> None:
        for a in self.agents.values():
            pids = a.supervisor.pids()
            a.close()
            for pid in pids.values():
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)


def summary() -> str:
    return "; ".join(
        f"{r.state}:{r.reason}:{[(s.node_id, s.state, s.reason) for s in r.shards.all()]}"
        for r in Replica.objects.prefetch_related("shards")
    )


def ready() -> list[Replica]:
    return list(Replica.objects.filter(state="ready"))


def sdk_streams(client: openai.OpenAI) -> Callable[[int, int], str]:
    """One streamed chat a call with OpenAI's SDK; it must end with one finish_reason 'length'."""

    def request(worker: int, n: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"worker {worker} turn {n}: tell me about GPUs"}],
            max_tokens=24,
            stream=True,
            extra_body=NOISE,
        )
        finished = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
        if finished != ["length"]:
            raise RuntimeError(f"the stream ended with {finished}, not one finish_reason 'length'")
        return ""

    return request


@pytest.fixture
def cluster(live_server, tmp_path, settings, monkeypatch, llama_server_bin):
    settings.LLMGW_JOIN_TOKEN = JOIN
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    settings.LLMGW_START_BACKOFF_BASE = 0.5
    # The agents find llama-server as a node does: on PATH.
    monkeypatch.setenv("PATH", f"{Path(llama_server_bin).parent}{os.pathsep}{os.environ['PATH']}")
    c = Cluster(live_server.url, tmp_path / "fleet", 3)
    try:
        yield c
    finally:
        c.close()


def test_llama_cpp_through_discovery_placement_the_gateway_a_drain_and_a_crash(
    cluster,
    gateway_factory,  # noqa: F811
    tiny_model,
    django_user_model,
    llama_server_bin,
):
    # Discovery: every node found the real llama-server by what it prints on stderr.
    printed = wire_engines.probe_version(wire_engines.get("llamacpp"), "", _run_version(llama_server_bin)).text
    assert printed
    for a in cluster.agents.values():
        a.step()
    assert {n.id: n.engine_versions for n in Node.objects.all()} == {
        nid: {"llamacpp": printed} for nid in cluster.agents
    }

    # Placement: a llama.cpp deployment under the name operators use; one replica a node (30 of 48 cores).
    prof = EngineProfile.objects.create(
        name="tiny-llama",
        engine="llamacpp",
        model_path=str(tiny_model),
        cpu_cores=30,
        args=["-c", "1024", "-np", "2", "-t", "1"],
        startup_timeout_s=60,
    )
    dep = Deployment.objects.create(name="tiny", served_model=MODEL, profile=prof, replicas=2)
    cluster.until(lambda: len(ready()) == 2)
    # No node was asked to install what it has.
    assert not Command.objects.filter(kind="install_engine").exists()
    argv_ports = sorted(Shard.objects.filter(replica__state="ready").values_list("http_port", flat=True))
    assert len(set(argv_ports)) == 2

    gw = gateway_factory("gateway", refresh_s=1.0)
    key = make_key(django_user_model.objects.create_user("alice", password="pw-alice-1"))
    gw.wait_ready(key, MODEL, 2, timeout=30)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)

    # OpenAI's SDK: a chat, the documentation's streaming loop, a completion.
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, extra_body=NOISE
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 8
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True, extra_body=NOISE
    ):
        streamed.append(chunk.choices[0].delta.content or "")
    assert "".join(streamed)
    done = client.completions.create(model=MODEL, prompt="The cluster", max_tokens=8, extra_body=NOISE)
    assert done.usage.completion_tokens == 8 and done.choices[0].text

    # llama.cpp's own prompt cache: a conversation's second turn reuses its first turn's prompt.
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many GPUs are free?"}]
    one = client.chat.completions.with_raw_response.create(model=MODEL, messages=first, max_tokens=4)
    reply = one.parse().choices[0].message.content
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And on rack 12?"}]
    two = client.chat.completions.with_raw_response.create(model=MODEL, messages=second, max_tokens=4)
    replica = one.headers["x-llmgw-replica"]
    assert two.headers["x-llmgw-replica"] == replica
    cached = two.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= one.parse().usage.prompt_tokens - 1
    endpoint = Replica.objects.get(id=replica).endpoint
    scrape = httpx.get(f"{endpoint}/metrics", timeout=5).text
    load = wire_engines.engine_load("llamacpp", printed, scrape)
    assert load is not None and 0 < load.hit_ratio < 1

    # A drain under streaming load: the replacement comes up on the third node, no request fails.
    drained = Shard.objects.filter(replica__state="ready").order_by("node_id").first().node_id
    with Load(sdk_streams(client), workers=3, join_s=60) as load_run:
        wait = time.monotonic() + 30
        while load_run.ok < 5 and time.monotonic() < wait:
            time.sleep(0.05)
        change_state(drained, "draining", now=timezone.now(), reason="maintenance")
        cluster.until(lambda: NodeEvent.objects.filter(node_id=drained, kind="drained").exists(), timeout=90)
        served_before = load_run.ok
        cluster.until(lambda: load_run.ok >= served_before + 5, timeout=30)
    assert load_run.failures == [], gw.tail()
    assert load_run.ok >= 10
    assert not Shard.objects.filter(node_id=drained, replica__state="ready").exists()
    assert len(ready()) == 2

    # The engine dies: its shard fails with what llama-server last printed, and the replica is rebuilt.
    victim = Shard.objects.filter(replica__state="ready").order_by("node_id").first()
    os.kill(cluster.pids()[str(victim.id)], signal.SIGKILL)
    cluster.until(lambda: Shard.objects.get(id=victim.id).state == "failed")
    victim.refresh_from_db()
    # Killed, it printed nothing more: the reason says so and carries what it printed last, its own words.
    assert victim.reason.startswith("the engine was killed by SIGKILL")
    last = victim.output_tail.splitlines()[-1]
    assert victim.reason.endswith(last[-200:].strip())
    # llama-server's own log lines (its slots at work), not the agent's words.
    assert " slot " in victim.output_tail
    cluster.until(lambda: len(ready()) == 2 and victim.replica_id not in {r.id for r in ready()}, timeout=90)
    assert dep.replica_set.filter(state="ready").count() == 2


def _run_version(binary) -> str:
    """What the built llama-server prints for --version, on stderr (its stdout stays empty)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout == ""
    return done.stderr
