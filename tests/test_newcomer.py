"""The README's first hour, as a newcomer lives it, on a clean copy of the checkout.

The README's "first hour" block is read and run as written: `make run` (which
builds its own virtualenv from requirements.txt, on the embedded default:
SQLite and the filesystem broker), `make demo` with a few simulated nodes, an
operator API token the way the README says. Then, through the API, an echo
deployment whose replica must answer an OpenAI request, a drain that must
move it, and headless Chromium on the admin, the NVLink racks and the API
docs, with no console error and no request leaving the server. Any README
step that breaks fails this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.cleanenv import (
    Background,
    clean_env,
    copy_tracked_files,
    free_port,
    group_alive,
    kill_processes_under,
    processes_under,
    wait_until,
)

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
NODES = 4
# What the developer's own shell has set for the test suite, which a newcomer does not have.
STORE_SETTINGS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LLMGW_CACHE_PREFIX", "SECRET_KEY", "DEBUG")


def readme_first_hour(readme: Path) -> list[str]:
    """The commands of the README's first-hour block (marked `<!-- runnable: newcomer -->`), comments stripped."""
    text = readme.read_text()
    block = re.search(r"^<!-- runnable: newcomer -->\n```bash\n(.*?)```", text, re.S | re.M).group(1)
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


def test_a_newcomer_follows_the_readme(tmp_path):
    checkout = copy_tracked_files(tmp_path / "llmgw")
    steps = readme_first_hour(checkout / "README.md")
    run_step = next(s for s in steps if s.endswith("make run"))
    demo_step = next(s for s in steps if s.endswith("make demo"))
    rest = [s for s in steps if s not in (run_step, demo_step)]
    assert any("api_token create" in s for s in rest), steps

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in clean_env().items() if k not in STORE_SETTINGS}
    env |= {
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_LISTEN": f"127.0.0.1:{port}",
        # Other suites share this machine's ports; a newcomer's machine is not shared.
        "LLMGW_SHARD_PORT_BASE": str(free_port()),
        "NODES": str(NODES),
    }
    server = demo = None
    try:
        # Terminal 1: make run, until it says it is up; and when it says so, it answers.
        server = Background(["bash", "-c", run_step], cwd=checkout, env=env, log=tmp_path / "make-run.log")
        wait_until(
            lambda: "llmgw is up" in server.output() or not server.alive(),
            timeout=900,
            what="make run saying llmgw is up",
            context=server.output,
        )
        assert server.alive(), f"make run stopped:\n{server.output()[-6000:]}"
        assert httpx.get(f"{base}/admin/login/", timeout=10).status_code == 200
        login = re.search(r"admin login created: user '([^']+)', password '([^']+)'", server.output())
        assert login, server.output()[-3000:]
        username, password = login.groups()

        # Terminal 2: make demo.
        demo = Background(["bash", "-c", demo_step], cwd=checkout, env=env, log=tmp_path / "make-demo.log")

        # Terminal 3: the token, and whatever else the block says, as written.
        script = "set -euo pipefail\n" + "\n".join(rest) + '\nprintf "\\n@@TOKEN=%s\\n" "$TOKEN"\n'
        third = subprocess.run(
            ["bash", "-c", script], cwd=checkout, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert third.returncode == 0, f"README block failed:\n{third.stdout}\n{third.stderr}"
        token = re.search(r"^@@TOKEN=(\S+)$", third.stdout, re.M).group(1)
        api = httpx.Client(base_url=f"{base}/api/v1", headers={"Authorization": f"Token {token}"}, timeout=30)

        def logs() -> str:
            return f"--- make run\n{server.output()[-4000:]}\n--- make demo\n{demo.output()[-3000:]}"

        def ready_nodes() -> bool:
            assert demo.alive(), logs()
            return api.get("/nodes/", params={"state": "ready"}).json()["count"] == NODES

        wait_until(ready_nodes, timeout=300, what=f"{NODES} simulated nodes ready", context=logs)

        # make demo's agents are configured with nothing but the control plane: they hold the wakeup
        # long-poll on the gateway make run started, because the control plane names it in its answers.
        agent_logs = sorted((tmp_path / "var" / "simulate").glob("*/agent.log"))
        assert len(agent_logs) == NODES, agent_logs
        wait_until(
            lambda: all("wakeup: long-poll held at http://" in p.read_text() for p in agent_logs),
            timeout=60,
            what="every simulated agent holding the wakeup long-poll",
            context=lambda: "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in agent_logs),
        )
        assert not [p for p in agent_logs if "commands arrive with heartbeats" in p.read_text()]

        profile = api.post("/profiles/", json={"name": "echo-1", "engine": "echo", "gpus_per_node": 1})
        assert profile.status_code == 201, profile.text
        deployment = api.post(
            "/deployments/",
            json={"name": "echo", "served_model": "echo", "profile": profile.json()["id"], "replicas": 1},
        )
        assert deployment.status_code == 201, deployment.text

        def answering_replica(avoid: str = "") -> dict | None:
            """A ready replica not on `avoid` whose endpoint answers a chat completion."""
            for rep in api.get("/replicas/", params={"state": "ready"}).json()["results"]:
                # `make demo` has a deployment of its own (the gateway's demo): only ours counts here.
                if rep["deployment_name"] != "echo":
                    continue
                if avoid and any(s["node"] == avoid for s in rep["shards"]):
                    continue
                try:
                    answer = httpx.post(
                        f"{rep['endpoint']}/v1/chat/completions",
                        json={"model": "echo", "messages": [{"role": "user", "content": "hello newcomer"}]},
                        timeout=10,
                    )
                except httpx.HTTPError:
                    continue
                if answer.status_code == 200:
                    assert answer.json()["choices"][0]["message"]["content"] == "hello newcomer"
                    return rep
            return None

        first = wait_until(answering_replica, timeout=300, what="the echo replica answering", context=logs)
        node = first["shards"][0]["node"]

        # A drain moves it: a new replica elsewhere answers, and nothing stays on the drained node.
        drained = api.post(f"/nodes/{node}/drain/", json={"reason": "newcomer test"})
        assert drained.status_code == 200, drained.text
        ours = [r["replica_id"] for r in drained.json()["replicas_to_move"] if r["deployment"] == "echo"]
        assert ours == [first["id"]]
        moved = wait_until(
            lambda: answering_replica(avoid=node), timeout=300, what=f"the replica moved off {node}", context=logs
        )
        assert moved["id"] != first["id"]

        def drained_empty() -> bool:
            reps = api.get("/replicas/").json()["results"]
            live = [r for r in reps if r["state"] not in ("stopped", "failed")]
            return not any(s["node"] == node for r in live for s in r["shards"])

        def replicas_now() -> str:
            reps = api.get("/replicas/").json()["results"]
            rows = [
                f"{r['deployment_name']} {r['id']} {r['state']} {[(s['node'], s['state']) for s in r['shards']]} "
                f"{r.get('reason', '')} {r.get('pending_reasons', '')}"
                for r in reps
            ]
            return "--- replicas\n" + "\n".join(rows) + "\n" + logs()

        wait_until(drained_empty, timeout=180, what=f"{node} left empty", context=replicas_now)

        browse(base, username, password)
    finally:
        for proc in (demo, server):
            if proc is not None:
                proc.stop()
        # The simulated agents stop their echo engines on an orderly stop: give them a moment, then
        # kill what is left, so that nothing outlives the test whatever happened.
        end = time.monotonic() + 20
        while processes_under(tmp_path) and time.monotonic() < end:
            time.sleep(0.5)
        strays = kill_processes_under(tmp_path)
    assert not group_alive(server.proc.pid) and not group_alive(demo.proc.pid)
    assert strays == {}


def browse(base: str, username: str, password: str) -> None:
    """Log in and load the admin, the NVLink racks and the API docs; no console error, nothing off the server."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()

            def route(r):
                if r.request.url.startswith(base + "/"):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.on("console", lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
            page.goto(f"{base}/admin/login/?next=/admin/")
            page.fill("#id_username", username)
            page.fill("#id_password", password)
            page.click("input[type=submit]")
            page.wait_for_url(f"{base}/admin/")
            assert page.locator("#site-name").count() == 1
            page.goto(f"{base}/admin/nvlink/")
            page.wait_for_selector("section.rack")
            page.goto(f"{base}/api/docs/")
            # Swagger UI rendered the document: its title and the operations are on the page.
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            page.wait_for_selector(".opblock", timeout=30_000)
            assert "llmgw API" in page.inner_text(".swagger-ui .info .title")
        finally:
            browser.close()
    assert errors == []
    assert outside == []
