"""The supervisor: echo shards started, watched, failed, stopped and adopted, as real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

import llmgw_wire as wire
from llmgw_agent import engines
from llmgw_agent.supervisor import Supervisor, TransitionError, proc_identity
from tests.llmgw_agent.helpers import echo_start, wait_for

S = wire.ShardState
pytestmark = pytest.mark.slow


@pytest.fixture
def sup(tmp_path):
    sups: list[Supervisor] = []

    def make(**kw) -> Supervisor:
        s = Supervisor(tmp_path / "state", keep_finished_s=60, **kw)
        sups.append(s)
        return s

    yield make
    # Never leave an engine behind.
    for s in sups:
        for shard in s.shards.values():
            if shard.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(shard.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(shard.pid, 0)
        s.close()


def _state(s: Supervisor, shard_id: str) -> S:
    s.poll()
    return s.shards[shard_id].st


def test_echo_shard_loading_then_ready_with_env(sup, tmp_path):
    s = sup(mgmt_interface="eth9")
    cmd = echo_start("s1", load=0.6, gpu_indices=[2, 3], hcas=["mlx5_0", "mlx5_1"], nvlink_domain="dom-a")
    shard = s.start(cmd)
    assert shard.st == S.STARTING
    assert _state(s, "s1") == S.LOADING
    wait_for(lambda: _state(s, "s1") == S.READY)
    raw = Path(f"/proc/{shard.pid}/environ").read_bytes().decode()
    env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert env["NCCL_SOCKET_IFNAME"] == "=eth9"
    assert env["GLOO_SOCKET_IFNAME"] == "eth9"
    assert env["NCCL_MNNVL_ENABLE"] == "1"
    # Its own session: a stop signals its whole process group.
    assert os.getpgid(shard.pid) == shard.pid
    record = json.loads((tmp_path / "state" / "shards" / "s1.json").read_text())
    assert (record["pid"], record["state"]) == (shard.pid, "ready")
    # Idempotent: the same start again is the same shard, not a second process.
    assert s.start(cmd).pid == shard.pid
    assert [x.state for x in s.statuses()] == [S.READY]


def test_killed_shard_is_failed_with_exit_code_and_log(sup):
    s = sup()
    shard = s.start(echo_start("s1", load=0))
    wait_for(lambda: _state(s, "s1") == S.READY)
    os.kill(shard.pid, signal.SIGKILL)
    wait_for(lambda: _state(s, "s1") == S.FAILED)
    (st,) = s.statuses()
    # Nothing it printed reads as an error: its last line, said to be only that.
    last = 'echo: 127.0.0.1 "GET /health HTTP/1.1" 200 -'
    assert (st.state, st.exit_code, st.reason) == (
        S.FAILED,
        -9,
        f"the engine was killed by SIGKILL; its last output: {last}",
    )
    assert any("echo: serving 'demo'" in line for line in st.log_tail)
    assert st.log_tail[-1] == last
    # Nothing left to adopt.
    assert s.running() == []


def test_startup_timeout_fails_the_shard(sup):
    now = [1000.0]
    s = sup(kill_grace_s=0.2, clock=lambda: now[0])
    shard = s.start(echo_start("s1", load=30, startup_timeout_s=0.5))
    pid = shard.pid
    loading = 'echo: 127.0.0.1 "GET /health HTTP/1.1" 503 -'
    # Still loading when its time runs out: what it said last comes with the reason.
    wait_for(lambda: _state(s, "s1") == S.LOADING and s.log_tail("s1")[-1:] == [loading])
    now[0] += 1
    assert _state(s, "s1") == S.FAILED
    assert s.shards["s1"].reason == f"not ready after 0.5s; its last output: {loading}"
    now[0] += 1
    wait_for(lambda: (s.poll(), proc_identity(pid) is None)[1])


def test_stop_sigterm(sup):
    s = sup()
    shard = s.start(echo_start("s1", load=0))
    wait_for(lambda: _state(s, "s1") == S.READY)
    s.stop("s1", grace_s=5, reason="drain")
    assert s.shards["s1"].st == S.DRAINING
    wait_for(lambda: _state(s, "s1") == S.STOPPED)
    assert s.shards["s1"].exit_code == 0  # echo exits cleanly on SIGTERM
    assert proc_identity(shard.pid) is None
    # Stopping again is a no-op.
    assert s.stop("s1").st == S.STOPPED


def test_stop_escalates_to_sigkill_after_grace(sup):
    s = sup()
    s.start(echo_start("s1", load=0, args=["--ignore-sigterm"]))
    wait_for(lambda: _state(s, "s1") == S.READY)
    s.stop("s1", grace_s=0.5)
    s.poll()
    assert s.shards["s1"].st == S.DRAINING
    wait_for(lambda: _state(s, "s1") == S.STOPPED, timeout=5)
    assert s.shards["s1"].exit_code == -9


def test_restart_adopts_running_shard_then_stops_it(sup, tmp_path):
    first = sup()
    shard = first.start(echo_start("s1", load=0, replica_id="rep-7", gpu_indices=[1]))
    wait_for(lambda: _state(first, "s1") == S.READY)
    first.close()
    # The agent restarts: a new supervisor over the same state directory.
    second = sup()
    (running,) = second.running()
    assert (running.shard_id, running.replica_id, running.pid, running.gpu_indices) == ("s1", "rep-7", shard.pid, [1])
    wait_for(lambda: _state(second, "s1") == S.READY)
    second.stop("s1", grace_s=5)
    wait_for(lambda: _state(second, "s1") == S.STOPPED)
    assert proc_identity(shard.pid) is None
    first.shards.clear()


def test_record_with_reused_pid_is_not_adopted(sup, tmp_path):
    state = tmp_path / "state" / "shards"
    state.mkdir(parents=True)
    # Our own pid, but another start time and command line: not the engine.
    mine = proc_identity(os.getpid())
    rec = {
        "shard_id": "old",
        "pid": os.getpid(),
        "proc_start": mine[0] + 1,
        "argv": ["vllm", "serve"],
        "state": "ready",
    }
    (state / "old.json").write_text(json.dumps(rec))
    s = sup()
    assert s.running() == []
    (st,) = s.statuses()
    assert (st.shard_id, st.state, st.reason) == (
        "old",
        S.FAILED,
        "the engine process ended while the agent was not running",
    )
    assert not (state / "old.json").exists()


def test_gpu_conflict_and_unknown_engine_fail_without_starting(sup):
    s = sup()
    s.start(echo_start("s1", load=0, gpu_indices=[0, 1]))
    other = s.start(echo_start("s2", load=0, gpu_indices=[1]))
    assert (other.st, other.reason, other.pid) == (S.FAILED, "GPU 1 is held by shard s1", None)
    bad = echo_start("s3")
    bad.profile.engine = "tgi"
    assert s.start(bad).reason == "shard s3: unknown engine 'tgi' (known: vllm, sglang, llamacpp, echo)"


def test_missing_engine_binary_fails(sup):
    s = sup(base_env={"PATH": "/nonexistent"})
    cmd = echo_start("s1")
    cmd.profile.engine, cmd.profile.model_path = "llama-server", "/models/x.gguf"
    shard = s.start(cmd)
    assert shard.st == S.FAILED
    assert shard.reason.startswith("cannot start llama-server")


def test_a_multinode_vllm_shard_is_told_the_address_of_its_interface(sup, tmp_path):
    # A stand-in `vllm` on PATH that writes down what it was told, then waits to be stopped.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    told = tmp_path / "told"
    script = bin_dir / "vllm"
    script.write_text(f'#!/bin/sh\necho "$VLLM_HOST_IP $NCCL_SOCKET_IFNAME" > {told}\nexec sleep 30\n')
    script.chmod(0o755)
    asked: list[str] = []

    def address_of(name: str) -> str:
        asked.append(name)
        return {"ens8f0": "10.20.0.12"}.get(name, "")

    s = sup(base_env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, mgmt_interface="eno1", address_of=address_of)
    cmd = echo_start("s1", nnodes=2, rank=1, leader_addr="10.20.0.11", leader_port=29500, mgmt_interface="ens8f0")
    cmd.profile.engine, cmd.profile.model_path = "vllm", "/models/x"
    s.start(cmd)
    assert wait_for(lambda: told.exists() and told.read_text().strip()) == "10.20.0.12 =ens8f0"
    assert asked == ["ens8f0"]


def test_log_rotation_keeps_backups(sup, tmp_path):
    s = sup(log_backups=2)
    log = s.log_path("s1")
    log.write_text("first run\n")
    s.start(echo_start("s1", load=0))
    wait_for(lambda: _state(s, "s1") == S.READY)
    assert (tmp_path / "state" / "logs" / "s1.log.1").read_text() == "first run\n"


def test_a_running_shards_log_is_rotated_once_it_outgrows_log_max_bytes(sup):
    s = sup(log_max_bytes=64, log_backups=1)
    shard = s.start(echo_start("s1", load=0))
    log = s.log_path("s1")
    wait_for(lambda: _state(s, "s1") == S.READY and log.with_name("s1.log.1").exists())
    assert log.with_name("s1.log.1").read_text().startswith("# llmgw-agent: starting")
    assert log.stat().st_size < log.with_name("s1.log.1").stat().st_size
    assert proc_identity(shard.pid) is not None  # the engine runs on, writing to the same file


def test_a_served_name_with_shell_characters_reaches_the_engine_as_one_argument(sup, tmp_path):
    marker = tmp_path / "touched"
    cmd = echo_start("s1", load=0)
    cmd.profile.served_model_name = f"demo; touch {marker}"
    sup().start(cmd)
    models = wait_for(lambda: _models(cmd.http_port))
    assert [m["id"] for m in models] == [f"demo; touch {marker}"]
    assert not marker.exists()


def test_secret_args_are_masked_in_the_shard_log_but_reach_the_engine(sup, monkeypatch):
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "--api-key", "sk-live-123", "--hf-token=hf_abc"]
    monkeypatch.setattr(engines, "build", lambda cmd, **kw: engines.Launch(argv=list(argv), health_path=None))
    s = sup()
    shard = s.start(echo_start("s1", load=0))
    assert shard.argv == argv
    # The command line the kernel shows is the engine's once the child has exec'd it, not at once after the fork.
    wait_for(lambda: (proc_identity(shard.pid) or (None, None))[1] == argv)
    os.kill(shard.pid, signal.SIGKILL)
    wait_for(lambda: _state(s, "s1") == S.FAILED)
    (st,) = s.statuses()
    masked = [sys.executable, "-c", "import time; time.sleep(60)", "--api-key", "***", "--hf-token=***"]
    assert st.log_tail == [f"# llmgw-agent: starting {masked!r}"]


def _models(port: int) -> list[dict] | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False, timeout=1).json()["data"]
    except (httpx.HTTPError, KeyError):
        return None


def test_invalid_transition_refused(sup):
    s = sup()
    shard = s.start(echo_start("s1", load=0))
    wait_for(lambda: _state(s, "s1") == S.READY)
    with pytest.raises(TransitionError):
        s._move(shard, S.LOADING)


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"gpu_indices": [63]}, "this node has no GPU 63 (it has [0, 1, 2, 3, 4, 5, 6, 7])"),
        ({"gpu_indices": [1, 8, 9]}, "this node has no GPU 8,9 (it has [0, 1, 2, 3, 4, 5, 6, 7])"),
        ({"gpu_indices": [2, 2]}, "GPU indices [2, 2] name a card twice"),
        ({"gpu_indices": [0], "hcas": ["mlx5_0", "mlx5_7"]}, "this node has no adapter mlx5_7 (it has ['mlx5_0'])"),
    ],
)
def test_a_start_that_does_not_fit_this_node_is_refused_without_starting(sup, kw, reason):
    s = sup()
    s.gpus, s.hcas = frozenset(range(8)), frozenset({"mlx5_0"})
    shard = s.start(echo_start("s1", **kw))
    assert (shard.st, shard.reason, shard.pid) == (S.FAILED, reason, None)
    # Said in the next heartbeat.
    [status] = s.statuses()
    assert (status.shard_id, status.state, status.reason) == ("s1", S.FAILED, reason)


def test_unknown_hardware_is_not_checked(sup):
    s = sup()
    assert s.gpus is None and s.hcas is None
    shard = s.start(echo_start("s1", load=0, gpu_indices=[5], hcas=["mlx5_3"]))
    assert shard.st == S.STARTING and shard.pid


def test_no_more_live_shards_than_a_heartbeat_reports(sup, monkeypatch):
    monkeypatch.setattr(wire, "MAX_SHARDS", 2)
    s = sup()
    s.start(echo_start("s1", load=30))
    s.start(echo_start("s2", load=30))
    third = s.start(echo_start("s3", load=30))
    assert (third.st, third.pid) == (S.FAILED, None)
    assert third.reason == "this node already runs 2 shards, the most a heartbeat can report"
    assert [st.shard_id for st in s.statuses()] == ["s1", "s2"]


# An engine that fails to start as vLLM does when its port is taken, after printing the
# secrets it was given: on its command line, in its environment, in its parsed arguments,
# and a token it found elsewhere (one the agent never knew).
FAILING_ENGINE = """\
import os, sys
key, token = sys.argv[2], os.environ["HF_TOKEN"]
print(f"engine: starting with --api-key {key}")
print(f"engine: environment HF_TOKEN={token}")
print(f"engine: args Namespace(api_key='{key}', hf_token='{token}', port=8000)")
print("engine: cached login " + "hf_" + "abcdefghij" * 3)
raise OSError(98, "Address already in use")
"""


def _engine(monkeypatch, tmp_path, source: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Shards run `python -u <script> args` (printing as it goes) instead of the engine the profile names."""
    script = tmp_path / "engine.py"
    script.write_text(source)
    argv = [sys.executable, "-u", str(script), *args]
    launch = engines.Launch(argv=argv, env=dict(env or {}), health_path="/health")
    monkeypatch.setattr(engines, "build", lambda cmd, **kw: launch)
    return argv


def test_a_failed_engine_names_its_cause_and_sends_its_output_redacted(sup, monkeypatch, tmp_path):
    token = "hf_" + "Zq9" * 12
    argv = _engine(monkeypatch, tmp_path, FAILING_ENGINE, "--api-key", "s3cret", env={"HF_TOKEN": token})
    s = sup()
    s.start(echo_start("s1"))
    wait_for(lambda: _state(s, "s1") == S.FAILED)
    (st,) = s.statuses()
    assert (st.state, st.exit_code) == (S.FAILED, 1)
    assert st.reason == "the engine exited with code 1: OSError: [Errno 98] Address already in use"
    assert st.log_tail == [
        f"# llmgw-agent: starting {[*argv[:-1], '***']!r}",
        "engine: starting with --api-key ***",
        "engine: environment HF_TOKEN=***",
        "engine: args Namespace(api_key=***, hf_token=***, port=8000)",
        "engine: cached login hf_***",
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "engine.py"}", line 7, in <module>',
        '    raise OSError(98, "Address already in use")',
        "OSError: [Errno 98] Address already in use",
    ]
    sent = st.model_dump_json()
    for secret in ("s3cret", token, "abcdefghij"):
        assert secret not in sent
    # The log on the node keeps what the engine wrote.
    assert f"engine: environment HF_TOKEN={token}" in s.log_tail("s1")


def test_a_tail_of_ten_thousand_long_lines_is_bounded(sup, monkeypatch, tmp_path):
    source = 'import sys\nfor i in range(10_000):\n    print(f"line {i:05d} " + "x" * 2000)\nsys.exit(3)\n'
    _engine(monkeypatch, tmp_path, source)
    s = sup()
    s.start(echo_start("s1"))
    wait_for(lambda: _state(s, "s1") == S.FAILED, timeout=30)
    (st,) = s.statuses()

    def cut(line: str, limit: int) -> str:
        return line[: limit - 1] + "…"

    # Lines of 1,024 characters at most, the last that fit in 8 KiB: seven of them.
    assert st.log_tail == [cut(f"line {i:05d} " + "x" * 2000, 1024) for i in range(9993, 10_000)]
    assert len("\n".join(st.log_tail).encode()) <= wire.TAIL_BYTES
    last = cut("line 09999 " + "x" * 2000, 300)
    assert st.reason == f"the engine exited with code 3; its last output: {last}"


def test_a_shard_that_died_while_the_agent_was_away_names_its_cause(sup, monkeypatch, tmp_path):
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    _engine(monkeypatch, tmp_path, f"import sys, time\nprint('engine: loading')\nprint({oom!r})\ntime.sleep(60)\n")
    first = sup()
    shard = first.start(echo_start("s1"))
    wait_for(lambda: first.log_tail("s1")[-1:] == [oom])
    first.close()
    os.kill(shard.pid, signal.SIGKILL)
    wait_for(lambda: proc_identity(shard.pid) is None)
    # The agent starts again and finds its shard gone.
    (st,) = sup().statuses()
    assert st.reason == f"the engine process ended while the agent was not running: {oom}"
    assert st.log_tail[1:] == ["engine: loading", oom]
