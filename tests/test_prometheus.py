"""A real Prometheus scraping a live control plane, gateway, simulated fleet and echo replicas.

Debian's Prometheus runs the scrape configuration docs/prometheus.md documents
(read from the page; only host names, file paths and the intervals changed) with
the shipped rules, on a free port and a storage directory of its own. Three
simulated nodes (two HGX H100 and one GB200 tray in an NVLink domain, real
agents serving their metrics behind a token) carry an echo deployment of two
replicas; the gateway serves it. Everything is ready before Prometheus starts,
so its first discovery already lists every target.

Then, through Prometheus' HTTP API: every discovered target is up; the series
carry the labels the docs promise (node, fabrics, NVLink domain, deployment,
replica) with the control plane's values; a few values are exact (cards per
node on both sides, replicas desired and ready, the gateway's requests); every
rule evaluates without error; every metric name the rules and the Grafana
dashboard read exists; every panel's expression returns data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from django.utils import timezone

from inventory import liveness
from inventory.doctor_refresh import refresh_doctor
from inventory.models import GPU, Node
from llmgw_agent import config as agent_config
from llmgw_agent.loop import Agent, DiscoveryProbe
from llmgw_sim.simulate import prepare_node
from placement import prometheus_sd
from placement.models import Deployment, EngineProfile, Replica
from placement.reconciler import reconcile
from tests.deploy.prometheus import RULES, binary, metric_names, recorded, rules
from tests.gateway.conftest import Gateway, chat, free_port, make_key
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "prometheus.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
JOIN = "prometheus-test-join-token"
SCRAPE_TOKEN = "prometheus-test-scrape-token"
AGENT_TOKEN = "prometheus-test-agent-token"
MODEL = "echo-chat"
REQUESTS = 6


def documented_config() -> str:
    """The one YAML block of docs/prometheus.md that configures Prometheus."""
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL) if "scrape_configs:" in b]
    assert len(blocks) == 1, "docs/prometheus.md has exactly one Prometheus configuration"
    return blocks[0]


def scrape_configuration(*, control_plane: str, gateway: str, alertmanager: str, files: Path) -> dict[str, Any]:
    """The documented configuration with this test's addresses, files and intervals: nothing else changes."""
    text = documented_config()
    swaps = {
        "llmgw.example.internal:8000": control_plane,
        "llmgw.example.internal:8080": gateway,
        "alertmanager.example.internal:9093": alertmanager,
        "/etc/prometheus/llmgw-metrics-token": str(files / "llmgw-metrics-token"),
        "/etc/prometheus/llmgw-agent-token": str(files / "llmgw-agent-token"),
        "/etc/prometheus/llmgw.rules.yml": str(RULES),
    }
    for old, new in swaps.items():
        assert old in text, f"docs/prometheus.md no longer says {old}"
        text = text.replace(old, new)
    cfg = yaml.safe_load(text)
    # Seconds, so that the test sees scrapes and rule evaluations within seconds (a scrape's
    # timeout is its interval: two seconds leave a loaded machine's control plane time to answer).
    assert {"scrape_interval", "evaluation_interval"} <= set(cfg["global"])
    cfg["global"].update(scrape_interval="2s", evaluation_interval="1s")
    return cfg


class Prometheus:
    """One prometheus process on a free port, its storage in a temporary directory."""

    def __init__(self, workdir: Path, cfg: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary("prometheus"),
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (each sample's labels and value as a float)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return [{"labels": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Killed: its storage is thrown away with the test's directory, nothing to flush."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


class Fleet:
    """Simulated nodes as in-process agents serving their metrics, stepped by the test with a reconcile pass."""

    def __init__(self, url: str, workdir: Path, profiles: list[str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        token = workdir / "join-token"
        token.write_text(JOIN)
        self.agents: list[Agent] = []
        for i, profile in enumerate(profiles):
            node = prepare_node(
                index=i, profile=profile, workdir=workdir, control_plane=url, token_file=token, heartbeat_interval=1
            )
            cfg = dataclasses.replace(
                agent_config.load(str(node.config)),
                root=str(node.root),
                metrics_listen="127.0.0.1:0",
                metrics_token=AGENT_TOKEN,
            )
            self.agents.append(Agent(cfg, probe=DiscoveryProbe(root=cfg.root, model_dirs=list(cfg.model_dirs))))

    def step(self) -> None:
        """What beat runs (a liveness sweep, a reconcile pass), then one heartbeat of each agent."""
        liveness.sweep(now=timezone.now())
        reconcile(now=timezone.now())
        for a in self.agents:
            a.step()

    def until(self, cond, *, timeout: float, what) -> Any:
        """Step the fleet until `cond()` is truthy; fail after the deadline saying `what()`."""
        end = time.monotonic() + timeout
        while True:
            self.step()
            got = cond()
            if got:
                return got
            if time.monotonic() > end:
                pytest.fail(f"not reached in {timeout:g}s: {what()}")
            time.sleep(0.2)

    def close(self) -> None:
        for a in self.agents:
            pids = a.supervisor.pids()
            a.close()
            for pid in pids.values():
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, template variables set to match everything."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\$\{?node\}?", ".*", target["expr"])
            assert "$" not in expr, f"{panel['title']}: a template variable the test does not know: {expr}"
            out.append((panel["title"], expr))
    for variable in dash.get("templating", {}).get("list", []):
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable.get("query", "") or "")
        if m:
            out.append((f"variable {variable['name']}", m.group(1)))
    return out


@pytest.fixture
def stack(live_server, tmp_path, settings, django_user_model):
    settings.LLMGW_JOIN_TOKEN = JOIN
    # The token is the only way in: no address is allowed, as in production.
    settings.LLMGW_METRICS_TOKEN, settings.LLMGW_METRICS_ALLOW = SCRAPE_TOKEN, []
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    fleet = Fleet(live_server.url, tmp_path / "fleet", ["hgx-h100", "hgx-h100", "gb200-nvl"])
    gateway = Gateway(
        tmp_path,
        "gateway",
        refresh_s=1.0,
        extra_env={"LLMGW_METRICS_TOKEN": SCRAPE_TOKEN, "LLMGW_METRICS_ALLOW": ""},
    )
    prometheus = None
    # The gateway process boots (seconds of imports) while the fleet comes up.
    booting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-boot").submit(gateway.start)
    try:
        fleet.step()
        profile = EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4, startup_timeout_s=60)
        Deployment.objects.create(name="chat", served_model=MODEL, profile=profile, replicas=2)
        fleet.until(
            lambda: Replica.objects.filter(state="ready").count() == 2,
            timeout=60,
            what=lambda: str(list(Replica.objects.values_list("state", "reason"))),
        )
        booting.result()
        key = make_key(django_user_model.objects.create_user("prom", password="pw-prom-1"))
        gateway.wait_ready(key, MODEL, 2)
        # A scrape only serves the doctor's kept results and queues their refresh for the worker; no
        # worker runs here, so the task runs as the worker would, before the first scrape.
        refresh_doctor()
        files = tmp_path / "prometheus"
        files.mkdir()
        (files / "llmgw-metrics-token").write_text(SCRAPE_TOKEN)
        (files / "llmgw-agent-token").write_text(AGENT_TOKEN)
        cfg = scrape_configuration(
            control_plane=urlsplit(live_server.url).netloc,
            gateway=f"127.0.0.1:{gateway.port}",
            alertmanager=f"127.0.0.1:{free_port()}",
            files=files,
        )
        prometheus = Prometheus(files, cfg)
        fleet.until(prometheus.ready, timeout=30, what=prometheus.tail)
        yield fleet, gateway, key, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        with contextlib.suppress(BaseException):
            booting.result()
        gateway.stop()
        fleet.close()


def test_a_real_prometheus_scrapes_the_documented_configuration(stack):
    fleet, gateway, key, prom = stack
    doc = prometheus_sd.targets()
    discovered = {(g["labels"]["job_kind"], g["targets"][0]) for g in doc}
    assert len(discovered) == 3 + 2  # three agents, two engines

    # Every target of the four jobs is found and up (the scrapes use the documented tokens).
    def all_up() -> bool:
        targets = prom.api("targets", state="active")["activeTargets"]
        seen = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets}
        return len(seen) == len(discovered) + 2 and set(seen.values()) == {"up"}

    fleet.until(all_up, timeout=30, what=lambda: json.dumps(prom.api("targets", state="active"))[:3000])

    def by(label: str, expr: str) -> dict[str, Any]:
        return {s["labels"][label]: s["value"] for s in prom.query(expr)}

    def settled(label: str, expr: str, want: dict[str, Any]) -> None:
        """Wait until the query reads `want` by `label` (a scrape of a loaded machine may time out once)."""
        fleet.until(lambda: by(label, expr) == want, timeout=20, what=lambda: f"{expr}: {by(label, expr)} != {want}")

    # The agents' series carry where each node sits, as the control plane knows it.
    nodes = {n.id: n for n in Node.objects.prefetch_related("fabrics")}
    labels_of = 'llmgw_node_up{job="llmgw-agents"}'

    def agents_labelled() -> dict[str, dict[str, str]] | None:
        got = {s["labels"]["node"]: s["labels"] for s in prom.query(labels_of)}
        return got if set(got) == set(nodes) else None

    up = fleet.until(agents_labelled, timeout=20, what=lambda: f"{labels_of}: {prom.query(labels_of)}")
    for node_id, labels in up.items():
        n = nodes[node_id]
        fabrics = ",".join(sorted(f.name for f in n.fabrics.all()))
        # An empty label is no label to Prometheus: a node outside any domain has no nvlink_domain.
        got = (labels.get("fabrics", ""), labels.get("nvlink_domain", ""), labels["state"])
        assert got == (fabrics, n.nvlink_domain, "ready")
    # The GB200 tray is in an NVLink domain; the H100s sit on an InfiniBand fabric.
    assert sorted("nvlink_domain" in labels for labels in up.values()) == [False, False, True]
    assert all(labels.get("fabrics") for node_id, labels in up.items() if "hgx" in node_id)

    # Cards per node: the control plane's count, and the agents' own sensors of them, agree with the database.
    cards = {n: float(GPU.objects.filter(node_id=n).count()) for n in nodes}
    assert sorted(cards.values()) == [4, 8, 8]
    settled("node", 'llmgw_node_gpus{job="llmgw"}', cards)
    settled("node", 'count by (node) (llmgw_node_gpu_memory_total_bytes{job="llmgw-agents"})', cards)

    # The engines' series carry their deployment and replica; replicas desired and ready are exact.
    ready = {str(r.id): r for r in Replica.objects.filter(state="ready").prefetch_related("shards")}
    leaders = {rid: next(sh.node_id for sh in r.shards.all() if sh.rank == 0) for rid, r in ready.items()}
    running = 'vllm:num_requests_running{job="llmgw-engines"}'

    def engines_listed() -> list[dict[str, Any]] | None:
        got = prom.query(running)
        return got if {s["labels"]["replica"] for s in got} == set(ready) else None

    engines = fleet.until(engines_listed, timeout=20, what=lambda: f"{running}: {prom.query(running)}")
    assert {
        s["labels"]["replica"]: (s["labels"]["deployment"], s["labels"]["engine"], s["labels"]["node"]) for s in engines
    } == {rid: ("chat", "echo", node) for rid, node in leaders.items()}
    settled("deployment", 'llmgw_replicas{job="llmgw",state="ready"}', {"chat": 2.0})
    settled("deployment", 'llmgw_deployment_replicas_desired{job="llmgw"}', {"chat": 2.0})

    # Gateway requests counted exactly. Two batches, each seen by Prometheus before the next: a
    # model's histogram series appear at its first request, so the rates over them (and the
    # quantiles of those) need a second scrape that moved.
    prompt = " ".join(f"w{i}" for i in range(40))
    counted = f'sum(llmgw_gateway_requests_total{{job="llmgw-gateway",model="{MODEL}",code="200"}})'
    for batch in (1, 2):
        with gateway.client(key) as c:
            for _ in range(REQUESTS):
                r = c.post("/v1/chat/completions", json=chat(prompt, model=MODEL))
                assert r.status_code == 200, r.text
        fleet.until(
            lambda n=batch * REQUESTS: [s for s in prom.query(counted) if s["value"] == n],
            timeout=15,
            what=lambda: f"{counted} = {prom.query(counted)}",
        )
    # Each routed replica reads 0 ejected, none yet having failed.
    settled("replica", 'llmgw_gateway_replica_ejected{job="llmgw-gateway"}', dict.fromkeys(ready, 0.0))
    # ... and seen by the engines, so the prefix-cache ratio has queries in its window.
    queries = 'sum(vllm:prefix_cache_queries_total{job="llmgw-engines"})'
    fleet.until(lambda: [s for s in prom.query(queries) if s["value"] >= 2 * REQUESTS], timeout=15, what=queries)

    # Every rule is evaluated without error against these real series.
    def evaluated() -> list[dict[str, Any]]:
        got = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return got if all(r.get("lastEvaluation", "").startswith("2") for r in got) else []

    got = fleet.until(lambda: evaluated(), timeout=15, what=lambda: json.dumps(prom.api("rules"))[:3000])
    assert len(got) == len(rules())
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in got] == [
        (r.get("record") or r["alert"], "ok", "") for r in rules()
    ]

    # Every metric name the rules and the dashboard read exists here: as a series, or declared by a
    # target's metadata (a family with no sample now), or recorded by the rules.
    series = set(prom.api("label/__name__/values"))
    declared = set(prom.api("metadata"))
    read = {n for r in rules() for n in metric_names(r["expr"])}
    read |= {n for _, expr in dashboard_queries() for n in metric_names(expr)}
    assert read - series - declared - set(recorded()) == set()

    # Every panel of the dashboard returns data: at least one sample, and a number (not NaN).
    def all_panels_answer() -> list[str]:
        dead = []
        for title, expr in dashboard_queries():
            samples = prom.query(expr)
            if not any(math.isfinite(s["value"]) for s in samples):
                dead.append(f"{title}: {expr} -> {samples}")
        return dead

    # The recording rules and the rates fill within a few evaluations.
    fleet.until(lambda: not all_panels_answer(), timeout=20, what=lambda: "\n".join(all_panels_answer()))
