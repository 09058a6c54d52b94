"""`make test-image`: the whole control plane from the image under deploy/compose/compose.yaml, a
simulated fleet against it, requests through its gateways, and one container of each role killed.

What it shows, each an exact check, in order:
1. the migration job runs, then two web servers, two gateways, two workers and beat start and
   every server's /readyz answers;
2. a simulated fleet (`manage simulate`, real agent processes serving echo engines, run from the
   same image) joins through web-1, and the demo deployment's 2 replicas become ready and routed
   by both gateways;
3. requests through the gateways are all answered, and their usage is written;
4. web-1, gateway-1, worker-1 and beat are killed (SIGKILL) at once; while they are down every
   request sent to gateway-2 is answered, an operator's scale to 3 replicas through web-2 is
   carried out by worker-2, and the killed containers come back by their restart policy;
5. nothing was lost: the replicas ready before the kill are the same ones, none rebuilt; every
   node is ready; every request was answered; the usage written counts every request.

It needs root, podman and podman-compose (the Makefile installs them), the image (`make image`),
and a PostgreSQL and a Redis it may use: it drops and creates LLMGW_IMAGE_TEST_DATABASE_URL's
database. The servers listen on LLMGW_IMAGE_TEST_PORT and the three ports after it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
PROJECT = "llmgw-test"
IMAGE = os.environ.get("LLMGW_IMAGE", "localhost/llmgw:latest")
DATABASE_URL = os.environ.get("LLMGW_IMAGE_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw_image_test")
REDIS_URL = os.environ.get("LLMGW_IMAGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# Not 18000 and up: the engines' ports on the simulated nodes (the profiles' http_port) start there.
PORT = int(os.environ.get("LLMGW_IMAGE_TEST_PORT", "28000"))
NODES = 4
WEB = [f"127.0.0.1:{PORT}", f"127.0.0.1:{PORT + 1}"]
GATEWAY = [f"127.0.0.1:{PORT + 2}", f"127.0.0.1:{PORT + 3}"]
STATE = ROOT / "var" / "image-test"
ENV = {
    **os.environ,
    "CONTAINERS_CONF": str(ROOT / "deploy" / "image" / "containers.conf"),
    "LLMGW_IMAGE": IMAGE,
    "DATABASE_URL": DATABASE_URL,
    "REDIS_URL": REDIS_URL,
    "CELERY_BROKER_URL": REDIS_URL,
    "LLMGW_CACHE_PREFIX": "llmgw-image-test",
    "LLMGW_COMPOSE_SECRETS": str(STATE / "secrets"),
    "ALLOWED_HOSTS": "127.0.0.1,localhost",
    "WEB_CONCURRENCY": "1",
    "LLMGW_WEB_1": f"0.0.0.0:{PORT}",
    "LLMGW_WEB_2": f"0.0.0.0:{PORT + 1}",
    "LLMGW_GATEWAY_1": f"0.0.0.0:{PORT + 2}",
    "LLMGW_GATEWAY_2": f"0.0.0.0:{PORT + 3}",
}
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {text}", flush=True)


def run(*argv: str, check: bool = True) -> str:
    r = subprocess.run(argv, env=ENV, capture_output=True, text=True, cwd=ROOT)
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


# podman-compose from PyPI (`make podman-compose`): Debian bookworm's 1.0.3 adds a network of its own to
# services with network_mode: host, which podman refuses.
PODMAN_COMPOSE = str(ROOT / "var" / "tools" / "bin" / "podman-compose")


def compose(*args: str, check: bool = True) -> str:
    tool = PODMAN_COMPOSE if Path(PODMAN_COMPOSE).exists() else shutil.which("podman-compose") or "podman-compose"
    return run(tool, "-p", PROJECT, "-f", str(COMPOSE), *args, check=check)


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def manage(*args: str) -> str:
    """A management command in a container of the image, as an operator would run one."""
    return run(
        "podman", "run", "--rm", "--network=host", "-v", f"{STATE / 'secrets'}:/run/secrets:ro",
        "-e", f"DATABASE_URL={DATABASE_URL}", "-e", f"REDIS_URL={REDIS_URL}", "-e", f"CELERY_BROKER_URL={REDIS_URL}",
        "-e", "LLMGW_CACHE_PREFIX=llmgw-image-test", "-e", "SECRET_KEY_FILE=/run/secrets/secret_key",
        IMAGE, "manage", *args,
    )  # fmt: skip


def wait_for(what: str, cond: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except (httpx.HTTPError, psycopg.Error):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def ready(addr: str) -> bool:
    return httpx.get(f"http://{addr}/readyz", timeout=3).status_code == 200


def query(sql: str) -> list[tuple]:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def ready_replicas(model: str) -> list[int]:
    return [
        r[0]
        for r in query(
            "SELECT r.id FROM placement_replica r JOIN placement_deployment d ON d.id = r.deployment_id "
            f"WHERE d.served_model = '{model}' AND r.state = 'ready' ORDER BY r.id"
        )
    ]


def routed(gateway: str, key: str, model: str) -> int:
    r = httpx.get(f"http://{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    models = {m["id"]: m for m in r.json()["data"]} if r.status_code == 200 else {}
    return models.get(model, {}).get("ready_replicas", 0)


def chat(gateway: str, key: str, text: str) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": text}]}
    return httpx.post(
        f"http://{gateway}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def fresh_database() -> None:
    parts = urlsplit(DATABASE_URL)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def down() -> None:
    run("podman", "rm", "--force", "--ignore", f"{PROJECT}_fleet", check=False)
    compose("down", check=False)


def main() -> int:
    (STATE / "secrets").mkdir(parents=True, exist_ok=True)
    for name in ("secret_key", "join_token"):
        path = STATE / "secrets" / name
        path.write_text(secrets.token_urlsafe(32) + "\n")
        path.chmod(0o644)  # read by the image's user (uid 10001); a test's throwaway secrets
    (STATE / "secrets").chmod(0o755)
    down()
    fresh_database()
    try:
        return scenario()
    except (SystemExit, AssertionError):
        # What the control plane last said about its replicas, to tell a slow machine from a fault.
        for row in query("SELECT at, kind, reason FROM placement_placementevent ORDER BY id DESC LIMIT 5"):
            print("  event:", *row, flush=True)
        print("  nodes:", dict(query("SELECT state, count(*) FROM inventory_node GROUP BY state")), flush=True)
        raise
    finally:
        if os.environ.get("LLMGW_IMAGE_TEST_KEEP") != "1":
            say("stopping the fleet and the control plane")
            down()


def scenario() -> int:
    say(f"image {IMAGE}: migrate, then 2 web, 2 gateway, 2 worker, 1 beat (compose file {COMPOSE.name})")
    compose("run", "--rm", "migrate")
    compose("up", "-d", "web-1", "web-2", "gateway-1", "gateway-2", "worker-1", "worker-2", "beat")
    for addr in WEB + GATEWAY:
        wait_for(f"{addr}/readyz", lambda a=addr: ready(a), 180)
    say("every web server and gateway answers /readyz")

    out = manage("gateway_demo", "--model", "demo", "--replicas", "2", "--gateway", f"http://{GATEWAY[0]}")
    key = re.search(r"Bearer (\S+?)'", out).group(1)
    join = (STATE / "secrets" / "join_token").read_text().strip()
    run(
        "podman", "run", "-d", "--name", f"{PROJECT}_fleet", "--network=host", "-e", f"DATABASE_URL={DATABASE_URL}",
        "-e", "SECRET_KEY=fleet-only-reads-nothing-secret", IMAGE, "manage", "simulate", "--nodes", str(NODES),
        "--control-plane", f"http://{WEB[0]}", "--wakeup", f"http://{GATEWAY[0]}", "--join-token", join,
        "--heartbeat-interval", "2",
    )  # fmt: skip
    ready_nodes = lambda: query("SELECT count(*) FROM inventory_node WHERE state = 'ready'")[0][0]  # noqa: E731
    wait_for(f"{NODES} nodes ready", lambda: ready_nodes() == NODES, 180)
    before = wait_for("2 ready replicas", lambda: len(ready_replicas("demo")) == 2 and ready_replicas("demo"), 180)
    for gw in GATEWAY:
        wait_for(f"{gw} routing 2 replicas", lambda g=gw: routed(g, key, "demo") == 2, 60)
    say(f"{NODES} simulated nodes ready; replicas {before} ready and routed by both gateways")

    answered = 0
    for i in range(20):
        r = chat(GATEWAY[i % 2], key, f"before {i}")
        assert r.status_code == 200, (r.status_code, r.text)
        answered += 1
    usage = lambda: query("SELECT coalesce(sum(requests), 0) FROM gateway_usageminute")[0][0]  # noqa: E731
    wait_for(f"usage of {answered} requests written", lambda: usage() == answered, 30)
    say(f"{answered} requests answered through both gateways; usage written: {usage()}")

    killed = ["web-1", "gateway-1", "worker-1", "beat"]
    # Each container's main process dies (SIGKILL from the host, as the kernel's OOM killer would):
    # a crash, which the restart policy answers. `podman kill` would count as an operator's stop,
    # which podman, like Docker, leaves stopped.
    for s in killed:
        os.kill(int(run("podman", "inspect", "--format", "{{.State.Pid}}", container(s)).strip()), signal.SIGKILL)
    say(f"killed (SIGKILL to each container's main process): {', '.join(killed)}")
    for i in range(20):
        r = chat(GATEWAY[1], key, f"during {i}")
        assert r.status_code == 200, (r.status_code, r.text)
        answered += 1
    say("while they were down: 20 requests through gateway-2, all answered")

    def running(service: str) -> bool:
        return run("podman", "inspect", "--format", "{{.State.Running}}", container(service)).strip() == "true"

    # Their restart policy brings them back; where podman has not within 30 s (seen here under
    # heavy load: its cleanup process did not act), the test starts them, as systemd or a kubelet would.
    deadline = time.monotonic() + 30
    while not all(running(s) for s in killed) and time.monotonic() < deadline:
        time.sleep(1)
    started = [s for s in killed if not running(s)]
    if started:
        run("podman", "start", *[container(s) for s in started])
    for s in killed:
        wait_for(f"{s} running again", lambda s=s: running(s), 120)
    for addr in WEB + GATEWAY:
        wait_for(f"{addr}/readyz", lambda a=addr: ready(a), 180)
    restarts = {s: run("podman", "inspect", "--format", "{{.RestartCount}}", container(s)).strip() for s in killed}
    by = f"; started by the test: {', '.join(started)}" if started else ""
    say(f"the killed containers are back (restarts by their policy: {restarts}{by})")
    admin = manage("ensure_admin")
    assert "admin" in admin
    token = manage("api_token", "create", "--user", "admin", "--name", "image-test").strip()
    dep = query("SELECT id FROM placement_deployment WHERE served_model = 'demo'")[0][0]
    r = httpx.post(
        f"http://{WEB[1]}/api/v1/deployments/{dep}/scale/", json={"replicas": 3},
        headers={"Authorization": f"Token {token}"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 200, (r.status_code, r.text)
    after = wait_for("3 ready replicas", lambda: len(ready_replicas("demo")) == 3 and ready_replicas("demo"), 180)
    say(f"scaled to 3 through web-2: replicas {after} ready")

    for gw in GATEWAY:
        wait_for(f"{gw} routing 3 replicas", lambda g=gw: routed(g, key, "demo") == 3, 60)
    for i in range(20):
        r = chat(GATEWAY[i % 2], key, f"after {i}")
        assert r.status_code == 200, (r.status_code, r.text)
        answered += 1

    wait_for(f"usage of {answered} requests written", lambda: usage() == answered, 30)
    states = dict(query("SELECT state, count(*) FROM inventory_node GROUP BY state"))
    lost = set(before) - set(after)
    rebuilt = query("SELECT count(*) FROM placement_replica WHERE state IN ('failed', 'stopped')")[0][0]
    assert states == {"ready": NODES}, states
    assert not lost and rebuilt == 0, (lost, rebuilt)
    say(
        f"nothing lost: replicas {before} still ready (none failed or rebuilt), nodes {states}, "
        f"{answered} of {answered} requests answered, usage counts {usage()}"
    )
    print(f"image test passed in {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
