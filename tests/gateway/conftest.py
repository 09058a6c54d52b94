"""Real gateway data planes (granian processes on the test database and Redis) and echo replicas."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from gateway import keys, notify
from llmgw_sim import echo
from placement.models import Deployment, EngineProfile, Replica, ReplicaState

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], object], *, timeout: float, what: Callable[[], str] | str = "condition"):
    """Poll `cond` until it is truthy and return its value; fail after the deadline."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"not reached in {timeout:g}s: {what() if callable(what) else what}")
        time.sleep(0.05)


def database_url() -> str:
    """The test database (the one pytest-django created) as a DATABASE_URL."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        # The embedded default: the gateway process opens the same file.
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    return f"postgres://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or '5432'}/{s['NAME']}"


# How the tests' gateways are served unless a test names it: native (gateway/native.py, as
# scripts/gateway.sh serves it by default), asgi or rsgi (granian). LLMGW_TEST_GATEWAY_INTERFACE runs
# the whole suite on another.
INTERFACE = os.environ.get("LLMGW_TEST_GATEWAY_INTERFACE", "native")


def command(interface: str, port: int) -> list[str]:
    """The command line of one data plane process on 127.0.0.1:`port`, served as `interface` says."""
    if interface == "native":
        return [sys.executable, "-m", "gateway.native", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    return [sys.executable, "-m", "granian", "--interface", interface, "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1", f"gateway.{interface}:app"]  # fmt: skip


class Gateway:
    """One data plane process, as `make run` starts it (granian's ASGI, its RSGI, or the native server)."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        *,
        refresh_s: float = 30.0,
        extra_env: dict | None = None,
        interface: str = "",
    ) -> None:
        self.interface = interface or INTERFACE
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "0",
            "SECRET_KEY": "llmgw-test-key",
            "DATABASE_URL": database_url(),
            "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"),
            "LLMGW_CACHE_PREFIX": os.environ.get("LLMGW_CACHE_PREFIX", "llmgw-test"),
            # Long, so that a test seeing a change within a second proves the push, not the refresh.
            "LLMGW_GATEWAY_REFRESH": str(refresh_s),
            "LLMGW_GATEWAY_EJECT_FOR": "60",
            "LOG_LEVEL": "WARNING",
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the data plane's process and wait until it answers."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                command(self.interface, self.port),
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        def answers() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"the gateway exited with {self.proc.returncode}: {self.tail()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answers, timeout=60, what=self.tail)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def tail(self) -> str:
        """The end of its log."""
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def client(self, key: str | None, **kw) -> httpx.Client:
        """An HTTP client to this gateway, with `key` as its bearer token."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 20), **kw)

    def models(self, key: str) -> dict[str, dict]:
        """GET /v1/models, by id."""
        r = httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
        if r.status_code != 200:
            return {}
        return {m["id"]: m for m in r.json()["data"]}

    def wait_ready(self, key: str, model: str, n: int, timeout: float = 10.0) -> None:
        """Wait until this gateway routes `model` to `n` ready replicas."""
        wait_for(
            lambda: self.models(key).get(model, {}).get("ready_replicas") == n,
            timeout=timeout,
            what=lambda: f"{model} with {n} ready replicas; gateway has {self.models(key)}; log: {self.tail()}",
        )

    def metrics(self) -> str:
        """The data plane's /metrics text."""
        return httpx.get(f"{self.url}/metrics", timeout=5).text


@pytest.fixture(scope="module")
def gateway_factory(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Callable[..., Gateway]]:
    """Start data plane processes on demand; all are stopped at the end of the module."""
    started: list[Gateway] = []
    workdir = tmp_path_factory.mktemp("gateway")

    def make(name: str = "gateway", **kw) -> Gateway:
        g = Gateway(workdir, name, **kw)
        g.start()
        started.append(g)
        return g

    yield make
    for g in started:
        g.stop()


@pytest.fixture(scope="module")
def gateway(gateway_factory) -> Gateway:
    """One data plane for the module's tests."""
    return gateway_factory("gateway")


@pytest.fixture
def echoes() -> Iterator[Callable[..., echo.EchoServer]]:
    """Start echo replicas (real HTTP servers, in threads) on free ports; stopped after the test."""
    servers: list[echo.EchoServer] = []

    def make(model: str = "demo", **options) -> echo.EchoServer:
        srv = echo.serve(
            host="127.0.0.1", port=0, model=model, load_seconds=options.pop("load_seconds", 0.0), **options
        )
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def url_of(srv: echo.EchoServer) -> str:
    """An echo server's base URL."""
    return f"http://127.0.0.1:{srv.server_address[1]}"


def make_deployment(
    model: str, endpoints: list[str], *, desired: int | None = None, pending: str = ""
) -> list[Replica]:
    """A deployment of `model` with one ready replica per endpoint (and a pending one saying `pending`)."""
    now = timezone.now()
    profile = EngineProfile.objects.create(name=f"echo-{model}", engine="echo")
    dep = Deployment.objects.create(
        name=model, served_model=model, profile=profile, replicas=desired if desired is not None else len(endpoints)
    )
    reps = [
        Replica.objects.create(
            deployment=dep, state=ReplicaState.READY, endpoint=e, created_at=now, updated_at=now, ready_at=now
        )
        for e in endpoints
    ]
    if pending:
        Replica.objects.create(
            deployment=dep, state=ReplicaState.PENDING, reason=pending, created_at=now, updated_at=now
        )
    notify.publish("routes")
    return reps


def make_key(user, *, name: str = "k", **kw) -> str:
    """Create an API key for `user`; returns its secret."""
    _, secret = keys.create_key(name=name, owner=user, now=kw.pop("now", timezone.now()), **kw)
    return secret


@pytest.fixture
def user(django_user_model):
    """A key owner."""
    return django_user_model.objects.create_user("alice", password="pw-alice-1")


def chat(text: str, model: str = "demo", **extra) -> dict:
    """A chat completion request body."""
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


class Load:
    """Requests from several threads until stopped, every outcome kept.

    `request(worker, n)` sends one request and returns the replica that answered ("" when
    unknown), or raises: any exception is a failed request, whatever its kind.
    """

    def __init__(self, request: Callable[[int, int], str], workers: int = 6, *, join_s: float = 30.0) -> None:
        self.request, self.join_s = request, join_s
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.by_replica: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                replica = self.request(worker, n)
            except Exception as e:  # every failure is the finding
                with self.lock:
                    self.failures.append(f"{type(e).__name__}: {e}")
                continue
            with self.lock:
                self.ok += 1
                self.by_replica[replica] = self.by_replica.get(replica, 0) + 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.join_s)
