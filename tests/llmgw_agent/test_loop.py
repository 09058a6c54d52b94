"""The agent loop against a real tiny HTTP control plane: registration, credentials, commands, backoff."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import llmgw_wire as wire
from llmgw_agent import commands as commands_mod
from llmgw_agent import config as config_mod
from llmgw_agent.loop import Agent, NeedsRegister, Refused, Unreachable, backoff_delay
from tests.llmgw_agent.helpers import echo_start, wait_for

JOIN = "join-secret-123"


@dataclass
class Discovered:
    host: wire.Host = field(default_factory=lambda: wire.Host(os_id="ubuntu", arch="x86_64"))
    memory_total_mb: int = 64000
    cpu_count: int = 16
    gpus: list = field(default_factory=lambda: [wire.GPU(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3")])
    storage: list = field(default_factory=list)
    weights: list = field(default_factory=list)
    imex: wire.IMEX | None = None
    engine_versions: dict = field(default_factory=lambda: {"vllm": "0.11.0"})
    engines_probed: bool = True
    problems: list = field(default_factory=list)


@dataclass
class Sampled:
    load: wire.Load = field(default_factory=lambda: wire.Load(cpu_percent=12.5, cpu_count=16))
    gpus: list = field(default_factory=lambda: [wire.GPUSensor(index=0, temp_c=40)])
    ib_ports: list = field(default_factory=list)
    imex: wire.IMEX | None = None
    problems: list = field(default_factory=list)


@dataclass
class ToolResult:
    ok: bool
    stdout: str
    error: str


class Probe:
    """A probe of our own: fixed inventory and sensors, a scan that returns a fixed text."""

    def __init__(self):
        self.scans: list[tuple[str, int, float]] = []

    def discover(self):
        return Discovered()

    def sample(self, previous=None):
        return Sampled()

    def gpu_fabrics(self):
        return [wire.GPUFabricReport(index=0, fabric=wire.GPUFabric(state="Completed", cluster_uuid="c-1"))]

    def ibnetdiscover(self, *, hca, port, timeout):
        self.scans.append((hca, port, timeout))
        return ToolResult(ok=True, stdout='Switch 36 "S-0002c903"', error="")


class ControlPlane(ThreadingHTTPServer):
    """A tiny control plane: one credential per node, commands pending until acknowledged."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), CPHandler)
        self.requests: list[tuple[str, str, dict]] = []
        self.credentials: set[str] = set()
        self.pending: list[dict] = []
        self.fail_next = 0
        self.issued = 0
        self.scans: list[dict] = []
        # Credential rotation: whether heartbeats ask for it, and the status the rotate endpoint fails with.
        self.rotate = False
        # Node ids that hold a credential: a join token cannot take them over.
        self.taken: set[str] = set()
        self.rotate_fails: int | None = None
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class CPHandler(BaseHTTPRequestHandler):
    server: ControlPlane

    def log_message(self, *a):
        pass

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        cp = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
        with cp.lock:
            cp.requests.append((self.path, token, body))
            if cp.fail_next:
                cp.fail_next -= 1
                return self._send(503, {"detail": "down"})
            if self.path == "/api/v1/agent/register":
                wire.Register.model_validate(body)
                if token == JOIN and body["node_id"] in cp.taken:
                    return self._send(403, {"detail": "this node id is registered with its own credential"})
                if token == JOIN:
                    cp.issued += 1
                    cred = f"cred-{cp.issued}"
                    cp.credentials.add(cred)
                    return self._send(
                        200, {"node_id": body["node_id"], "credential": cred, "heartbeat_interval_s": 0.1}
                    )
                if token in cp.credentials:
                    return self._send(200, {"node_id": body["node_id"], "heartbeat_interval_s": 0.1})
                return self._send(401, {"detail": "bad token"})
            if token not in cp.credentials:
                return self._send(401, {"detail": "bad token"})
            if self.path == "/api/v1/agent/heartbeat":
                hb = wire.Heartbeat.model_validate(body)
                cp.pending = [c for c in cp.pending if c["id"] not in hb.acks]
                return self._send(
                    200,
                    {"commands": cp.pending, "heartbeat_interval_s": 0.1, "rotate_credential": cp.rotate or None},
                )
            if self.path == "/api/v1/agent/rotate":
                wire.RotateCredential.model_validate(body)
                if cp.rotate_fails:
                    return self._send(cp.rotate_fails, {"detail": "no"})
                cp.issued += 1
                cred = f"cred-{cp.issued}"
                cp.credentials.add(cred)
                cp.rotate = False
                return self._send(200, {"node_id": body["node_id"], "credential": cred, "heartbeat_interval_s": 0.1})
            if self.path == "/api/v1/agent/scans":
                cp.scans.append(body)
                return self._send(201, {})
        return self._send(404, {})


@pytest.fixture
def cp():
    server = ControlPlane()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def make_agent(tmp_path, cp):
    agents: list[Agent] = []

    def make(**kw) -> Agent:
        cfg = config_mod.parse(
            {
                "control_plane": cp.url,
                "join_token": JOIN,
                "node_id": "gpu-01",
                "state_dir": str(tmp_path / "state"),
                "heartbeat_interval": 0.1,
                "labels": {"zone": "a"},
                "fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}],
            }
        )
        a = Agent(cfg, probe=kw.pop("probe", Probe()), rng=random.Random(7), **kw)
        agents.append(a)
        return a

    yield make
    for a in agents:
        for s in a.supervisor.shards.values():
            if s.pid:
                try:
                    os.killpg(s.pid, signal.SIGKILL)
                    os.waitpid(s.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        a.close()


def test_first_registration_uses_join_token_and_keeps_credential(make_agent, cp, tmp_path, caplog):
    caplog.set_level("DEBUG")
    agent = make_agent()
    agent.step()
    (path, token, body), (hb_path, hb_token, hb) = cp.requests
    assert (path, token) == ("/api/v1/agent/register", JOIN)
    assert body["node_id"] == "gpu-01"
    assert body["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}]
    assert body["labels"] == {"zone": "a"}
    assert body["gpus"][0]["uuid"] == "GPU-a"
    assert (body["engine_versions"], body["engines_probed"]) == ({"vllm": "0.11.0"}, True)
    assert (hb_path, hb_token) == ("/api/v1/agent/heartbeat", "cred-1")
    assert hb["load"]["cpu_percent"] == 12.5
    cred = tmp_path / "state" / "credential"
    assert cred.read_text() == "cred-1"
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    # Restarted, it registers with its own credential, not the join token.
    cp.requests.clear()
    make_agent().register()
    assert cp.requests[0][1] == "cred-1"
    # Neither secret is ever logged.
    assert "registered as gpu-01" in caplog.text
    assert JOIN not in caplog.text and "cred-1" not in caplog.text


def test_reset_credential_falls_back_to_join_token(make_agent, cp, tmp_path):
    agent = make_agent()
    agent.step()
    cp.credentials.clear()  # an operator reset the node's credential
    cp.requests.clear()
    with pytest.raises(Exception, match="heartbeat refused"):
        agent.heartbeat()
    agent.step()
    assert [(p, t) for p, t, _ in cp.requests] == [
        ("/api/v1/agent/heartbeat", "cred-1"),
        ("/api/v1/agent/register", "cred-1"),
        ("/api/v1/agent/register", JOIN),
        ("/api/v1/agent/heartbeat", "cred-2"),
    ]
    assert (tmp_path / "state" / "credential").read_text() == "cred-2"


def test_rotation_requested_in_a_heartbeat_stores_and_uses_the_new_credential(make_agent, cp, tmp_path, caplog):
    caplog.set_level("DEBUG", logger="llmgw.agent")
    agent = make_agent()
    agent.step()
    cp.rotate = True
    cp.requests.clear()
    agent.heartbeat()
    agent.heartbeat()
    assert [(p, t, b) for p, t, b in cp.requests if p != "/api/v1/agent/heartbeat"] == [
        ("/api/v1/agent/rotate", "cred-1", {"node_id": "gpu-01"})
    ]
    assert [t for p, t, _ in cp.requests if p == "/api/v1/agent/heartbeat"] == ["cred-1", "cred-2"]
    cred = tmp_path / "state" / "credential"
    assert cred.read_text() == "cred-2"
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    # Written beside and renamed over: nothing temporary is left behind.
    assert sorted(p.name for p in cred.parent.iterdir() if "credential" in p.name) == ["credential"]
    assert "credential rotated" in caplog.text
    assert "cred-1" not in caplog.text and "cred-2" not in caplog.text
    # A restarted agent registers with the new credential.
    cp.requests.clear()
    make_agent().register()
    assert cp.requests[0][1] == "cred-2"


@pytest.mark.parametrize("status", [503, 400])
def test_failed_rotation_keeps_the_current_credential_and_retries(make_agent, cp, tmp_path, status):
    agent = make_agent()
    agent.step()
    cp.rotate, cp.rotate_fails = True, status
    agent.heartbeat()  # the failure is logged, not raised: the heartbeat itself went through
    assert (tmp_path / "state" / "credential").read_text() == "cred-1"
    cp.rotate_fails = None
    cp.requests.clear()
    agent.heartbeat()
    agent.heartbeat()
    assert [(p, t) for p, t, _ in cp.requests] == [
        ("/api/v1/agent/heartbeat", "cred-1"),
        ("/api/v1/agent/rotate", "cred-1"),
        ("/api/v1/agent/heartbeat", "cred-2"),
    ]


def test_bad_join_token_is_refused_not_fatal(make_agent, cp):
    agent = make_agent()
    agent.config = config_mod.parse({**_cfg_dict(agent), "join_token": "wrong"})
    with pytest.raises(Refused, match="join token was refused"):
        agent.register()


def test_join_token_refusals_name_the_key_and_the_file(make_agent, cp, tmp_path):
    agent = make_agent()
    token_file = tmp_path / "join-token"
    token_file.write_text("wrong\n")
    agent.config = config_mod.parse({**_cfg_dict(agent), "join_token_file": str(token_file)}, source="/etc/a.yaml")
    with pytest.raises(Refused) as exc:
        agent.register()
    assert str(exc.value) == (
        f"the join token was refused (401): join_token_file {str(token_file)!r} in /etc/a.yaml holds a token"
        " that is unknown, revoked, expired or used up; ask an operator for a new one"
    )
    agent.config = config_mod.parse(_cfg_dict(agent), source="/etc/a.yaml")
    with pytest.raises(Refused) as exc:
        agent.register()
    assert str(exc.value) == (
        "this node has no credential yet and /etc/a.yaml gives no join token:"
        " set join_token or join_token_file (an operator creates one)"
    )


def test_join_refused_for_a_node_with_a_credential_says_why(make_agent, cp):
    cp.taken.add("gpu-01")
    with pytest.raises(Refused) as exc:
        make_agent().register()
    assert str(exc.value) == (
        "the join token was refused: HTTP 403: this node id is registered with its own credential"
    )


def _cfg_dict(agent):
    c = agent.config
    return {"control_plane": c.control_plane, "node_id": c.node_id, "state_dir": c.state_dir}


def test_commands_applied_once_and_acknowledged(make_agent, cp):
    start = echo_start("s1", load=0, id="c-1").model_dump()
    cp.pending = [start, {"kind": "install_engine", "id": "c-2", "engine": "sglang", "version": "0.5.2"}]
    agent = make_agent()
    agent.step()
    shard = agent.supervisor.shards["s1"]
    pid = shard.pid
    assert agent.installs["sglang"].state == "unsupported"
    # The next heartbeat acknowledges both; the control plane then stops sending them.
    agent.heartbeat()
    acks = cp.requests[-1][2]["acks"]
    assert sorted(acks) == ["c-1", "c-2"]
    assert cp.pending == []
    # A command seen again (its ack lost) is acknowledged again, not applied again.
    cp.pending = [start]
    agent.heartbeat()
    assert agent.supervisor.shards["s1"].pid == pid
    agent.heartbeat()
    assert cp.requests[-1][2]["acks"] == ["c-1"]
    assert cp.pending == []
    wait_for(lambda: (agent.supervisor.poll(), agent.supervisor.shards["s1"].state == "ready")[1])
    hb = agent.heartbeat_body()
    assert [(s.shard_id, s.state) for s in hb.shards] == [("s1", wire.ShardState.READY)]
    assert hb.engine_installs[0].model_dump()["detail"].startswith("this agent does not install engines")
    # A stop, once.
    cp.pending = [{"kind": "stop_shard", "id": "c-3", "shard_id": "s1", "grace_s": 5}]
    agent.heartbeat()
    wait_for(lambda: (agent.supervisor.poll(), agent.supervisor.shards["s1"].state == "stopped")[1])


def test_applied_ids_survive_a_restart(make_agent, cp):
    cp.pending = [{"kind": "install_engine", "id": "c-9", "engine": "vllm", "version": "0.11.0"}]
    first = make_agent()
    first.step()
    assert first.installs["vllm"].state == "ready"
    second = make_agent()
    second.step()
    assert "vllm" not in second.installs  # not applied again, acknowledged at the next heartbeat
    second.heartbeat()
    assert cp.requests[-1][2]["acks"] == ["c-9"]
    assert cp.pending == []


def test_scan_fabric_uploads_ibnetdiscover_text(make_agent, cp):
    probe = Probe()
    cp.pending = [{"kind": "scan_fabric", "id": "c-5", "key": "sm:0x1", "hca": "mlx5_0", "port": 1, "timeout_s": 30}]
    agent = make_agent(probe=probe)
    agent.step()
    wait_for(lambda: cp.scans)
    (scan,) = cp.scans
    assert (scan["key"], scan["hca"], scan["command_id"], scan["output"]) == (
        "sm:0x1",
        "mlx5_0",
        "c-5",
        'Switch 36 "S-0002c903"',
    )
    assert probe.scans == [("mlx5_0", 1, 30.0)]
    wait_for(lambda: "c-5" in agent.journal)
    agent.heartbeat()
    agent.heartbeat()
    assert probe.scans == [("mlx5_0", 1, 30.0)]  # once


def test_backoff_while_unreachable_then_recovers(make_agent, cp):
    cp.fail_next = 3
    agent = make_agent()
    waits: list[float] = []
    agent._wait = waits.append
    agent.run(max_steps=5)
    # Three failures back off (growing, jittered), then register + heartbeat succeed.
    assert len(waits) == 5
    rng = random.Random(7)  # the agent's own seed: the same jitter, in the same order
    assert waits[:3] == [backoff_delay(n, rng) for n in (1, 2, 3)]
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0 and 2.0 <= waits[2] <= 4.0
    assert waits[3:] == [0.1, 0.1]
    assert agent.registered


def test_backoff_delay_is_bounded_and_jittered():
    rng = random.Random(1)
    delays = [backoff_delay(n, rng) for n in range(1, 12)]
    for n, d in enumerate(delays, start=1):
        ceiling = min(5.0, 2.0 ** (n - 1))
        assert ceiling / 2 <= d <= ceiling
    # Capped at a few seconds, so an agent is back within seconds of the control plane.
    assert max(delays) <= 5.0 and delays[-1] >= 2.5
    assert len({round(backoff_delay(5, rng), 6) for _ in range(10)}) > 1


def test_unreachable_control_plane_raises_transient(make_agent, cp):
    agent = make_agent()
    agent.http.base_url = "http://127.0.0.1:9"
    with pytest.raises(Unreachable):
        agent.register()


def test_unexpected_error_does_not_end_the_loop(make_agent, cp):
    class Broken(Probe):
        calls = 0

        def discover(self):
            Broken.calls += 1
            if Broken.calls == 1:
                raise RuntimeError("nvml exploded")
            return super().discover()

    agent = make_agent(probe=Broken())
    agent._wait = lambda s: None
    agent.run(max_steps=2)
    assert agent.registered


def test_gpu_fabrics_are_read_again_once_a_minute(make_agent, cp):
    t = [1000.0]
    agent = make_agent(clock=lambda: t[0])
    agent.register()
    t[0] = 1059.0
    assert agent.heartbeat_body().gpu_fabrics is None
    t[0] = 1060.0
    assert [(r.index, r.fabric.cluster_uuid) for r in agent.heartbeat_body().gpu_fabrics] == [(0, "c-1")]
    t[0] = 1061.0
    assert agent.heartbeat_body().gpu_fabrics is None


def test_heartbeats_within_a_minute_run_the_slow_tools_once(make_agent, tmp_path, monkeypatch):
    from llmgw_agent import discovery
    from llmgw_agent.loop import DiscoveryProbe

    from .conftest import PROFILES

    root = tmp_path / "hgx-h100"
    shutil.copytree(PROFILES / "hgx-h100", root)
    ran: list[str] = []
    real = discovery.run_tool

    def counting(argv, **kw):
        ran.append(argv[0])
        return real(argv, **kw)

    monkeypatch.setattr(discovery, "run_tool", counting)
    agent = make_agent(probe=DiscoveryProbe(root=root, model_dirs=[]))
    first = agent.heartbeat_body()
    # nvidia-smi twice: the sensors, and the NVLink fabrics a first heartbeat also reads.
    assert sorted(ran) == [
        "dmesg",
        "nvidia-imex-ctl",
        "nvidia-smi",
        "nvidia-smi",
        "saquery",
        "saquery",
        *["sminfo"] * 8,
    ]
    ran.clear()
    second = agent.heartbeat_body()
    assert ran == ["nvidia-smi"]
    assert second.ib_ports == first.ib_ports and second.ib_ports[4].sm_guid == "0x0002c90200259201"
    assert (second.gpus[6].wear.xid_errors, second.gpus[6].wear.last_xid) == (1, 31)


@pytest.mark.parametrize(
    ("status", "body", "raised"),
    [
        (404, {"detail": "no such node"}, NeedsRegister),  # the node was forgotten: register again
        (400, {"detail": "bad heartbeat"}, Refused),
        (200, {"commands": "not a list"}, Unreachable),  # an answer it cannot read is no answer
    ],
)
def test_heartbeat_answers_decide_what_the_loop_does_next(make_agent, status, body, raised):
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/agent/register":
            return httpx.Response(200, json={"node_id": "gpu-01", "credential": "cred-1"})
        return httpx.Response(status, json=body)

    agent = make_agent(http=httpx.Client(base_url="http://cp.test", transport=httpx.MockTransport(answer)))
    agent.register()
    with pytest.raises(raised) as exc:
        agent.heartbeat()
    assert agent.registered is (raised is not NeedsRegister)
    if raised is Refused:
        assert str(exc.value) == "heartbeat refused: HTTP 400: bad heartbeat"  # the control plane's words, not its JSON


def test_an_answer_with_more_commands_than_the_wire_allows_is_refused_whole(make_agent, cp):
    agent = make_agent()
    agent.step()
    one = echo_start("s0", load=0).model_dump()
    cp.pending = [{**one, "id": f"c-{i}", "shard_id": f"s{i}"} for i in range(wire.MAX_COMMANDS + 1)]
    with pytest.raises(Unreachable, match="unreadable heartbeat answer"):
        agent.heartbeat()
    assert agent.supervisor.shards == {}


def test_starts_are_capped_per_heartbeat_and_the_rest_come_again(make_agent, cp, monkeypatch):
    monkeypatch.setattr(commands_mod, "MAX_STARTS_PER_ANSWER", 3)
    agent = make_agent()
    agent.step()
    cp.pending = [echo_start(f"s{i}", load=30, id=f"c-{i}").model_dump() for i in range(7)]
    agent.heartbeat()
    assert sorted(agent.supervisor.shards) == ["s0", "s1", "s2"]
    agent.heartbeat()
    assert sorted(agent.supervisor.shards) == ["s0", "s1", "s2", "s3", "s4", "s5"]
    assert sorted(cp.requests[-1][2]["acks"]) == ["c-0", "c-1", "c-2"]
    agent.heartbeat()
    assert len(agent.supervisor.shards) == 7
    assert all(s.pid for s in agent.supervisor.shards.values())


def test_a_start_for_hardware_this_node_lacks_is_refused_and_said_in_the_next_heartbeat(make_agent, cp):
    agent = make_agent()
    agent.step()
    assert agent.supervisor.gpus == frozenset({0}) and agent.supervisor.hcas == frozenset({"mlx5_0"})
    cp.pending = [
        echo_start("s-gpu", load=0, id="c-1", gpu_indices=[63]).model_dump(),
        echo_start("s-hca", load=0, id="c-2", gpu_indices=[0], hcas=["mlx5_9"]).model_dump(),
    ]
    agent.heartbeat()
    agent.heartbeat()
    body = cp.requests[-1][2]
    assert sorted(body["acks"]) == ["c-1", "c-2"]
    assert {s["shard_id"]: (s["state"], s["reason"]) for s in body["shards"]} == {
        "s-gpu": ("failed", "this node has no GPU 63 (it has [0])"),
        "s-hca": ("failed", "this node has no adapter mlx5_9 (it has ['mlx5_0'])"),
    }
    assert all(s.pid is None for s in agent.supervisor.shards.values())


def test_a_join_is_retried_with_the_same_nonce_until_answered(make_agent, cp):
    """A join whose answer was lost is sent again with the nonce of the first try; once joined, it is dropped."""
    agent = make_agent()
    cp.fail_next = 1
    with pytest.raises(Unreachable):
        agent.register()
    nonce_file = agent.state_dir / "join-nonce"
    assert stat.S_IMODE(nonce_file.stat().st_mode) == 0o600
    agent.register()
    joins = [body["join_nonce"] for path, token, body in cp.requests if path.endswith("/register")]
    assert len(joins) == 2 and len(joins[0]) >= 32 and joins[0] == joins[1]
    assert not nonce_file.exists()
    # A registration with its own credential carries none.
    agent.register()
    assert "join_nonce" not in cp.requests[-1][2]
