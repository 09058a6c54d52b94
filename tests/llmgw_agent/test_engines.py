"""Engine command lines as exact argv snapshots, per engine and version; and the shard environment."""

from __future__ import annotations

import pytest

import llmgw_wire as wire
from llmgw_agent import engines


def _start(engine: str, *, tp=1, pp=1, nnodes=1, rank=0, **kw) -> wire.StartShard:
    profile = wire.EngineProfile(
        name="llama-70b-tp8",
        engine=engine,
        tp=tp,
        pp=pp,
        nodes=nnodes,
        model_path=kw.pop("model_path", "/models/Llama-3.3-70B-Instruct"),
        served_model_name="llama-3.3-70b",
        args=kw.pop("args", ["--max-model-len", "32768"]),
        env=kw.pop("env", {}),
    )
    return wire.StartShard(
        id="c1",
        replica_id="r1",
        shard_id="r1-0",
        rank=rank,
        nnodes=nnodes,
        leader_addr=kw.pop("leader_addr", "10.0.0.11" if nnodes > 1 else ""),
        leader_port=kw.pop("leader_port", 29500 if nnodes > 1 else None),
        http_port=8001,
        gpu_indices=kw.pop("gpu_indices", [0, 1, 2, 3, 4, 5, 6, 7]),
        profile=profile,
        **kw,
    )


def test_vllm_single_node():
    assert engines.build(_start("vllm", tp=8), version="0.10.2").argv == [
        "vllm", "serve", "/models/Llama-3.3-70B-Instruct",
        "--host", "0.0.0.0", "--port", "8001",
        "--served-model-name", "llama-3.3-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
        "--max-model-len", "32768",
    ]  # fmt: skip


@pytest.mark.parametrize("version", ["0.11.1", "0.11.2", "0.33.0", ""])
def test_vllm_multinode_leader_and_worker(version):
    leader = engines.build(_start("vllm", tp=8, pp=2, nnodes=2, rank=0), version=version)
    assert leader.argv == [
        "vllm", "serve", "/models/Llama-3.3-70B-Instruct",
        "--host", "0.0.0.0", "--port", "8001",
        "--served-model-name", "llama-3.3-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.11", "--master-port", "29500",
        "--max-model-len", "32768",
    ]  # fmt: skip
    assert leader.health_path == "/health"
    worker = engines.build(_start("vllm", tp=8, pp=2, nnodes=2, rank=1), version=version)
    assert worker.argv == [
        "vllm", "serve", "/models/Llama-3.3-70B-Instruct",
        "--host", "0.0.0.0", "--port", "8001",
        "--served-model-name", "llama-3.3-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.11", "--master-port", "29500",
        "--headless",
        "--max-model-len", "32768",
    ]  # fmt: skip
    assert worker.health_path is None


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.11.0rc1"])
def test_vllm_before_0_11_1_refuses_multinode(version):
    # 0.11.0 has no --nnodes/--node-rank/--master-addr/--master-port: it would die on them.
    with pytest.raises(engines.EngineError, match=rf"vllm {version} spans nodes only through Ray; .* >= 0\.11\.1$"):
        engines.build(_start("vllm", tp=8, nnodes=2, rank=0), version=version)
    # One node needs none of those flags.
    assert "--nnodes" not in engines.build(_start("vllm", tp=8), version=version).argv


def test_vllm_multinode_is_told_its_interfaces_address():
    start = _start("vllm", tp=8, nnodes=2, rank=1, mgmt_interface="ens8f0")
    env = engines.build(start, version="0.11.1", host_ip="10.20.0.12").env
    assert (env["VLLM_HOST_IP"], env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == (
        "10.20.0.12",
        "=ens8f0",
        "ens8f0",
    )
    # A single-node shard, another engine, or an unknown address: nothing to advertise.
    assert "VLLM_HOST_IP" not in engines.build(_start("vllm", tp=8), host_ip="10.20.0.12").env
    assert "VLLM_HOST_IP" not in engines.build(_start("sglang", tp=8, nnodes=2), host_ip="10.20.0.12").env
    assert "VLLM_HOST_IP" not in engines.build(_start("vllm", tp=8, nnodes=2), version="0.11.1").env


def test_sglang_multinode_ranks_are_told_their_interfaces_address():
    # sglang.srt.utils.get_ip reads SGLANG_HOST_IP, then HOST_IP; without them a rank advertises
    # the default route's address, which the other ranks may not reach.
    env = engines.build(_start("sglang", tp=16, nnodes=2, rank=1), version="0.5.2", host_ip="10.20.0.12").env
    assert (env["SGLANG_HOST_IP"], env["HOST_IP"]) == ("10.20.0.12", "10.20.0.12")
    assert "VLLM_HOST_IP" not in env
    assert "SGLANG_HOST_IP" not in engines.build(_start("sglang", tp=8), host_ip="10.20.0.12").env


def test_multinode_needs_a_leader():
    with pytest.raises(engines.EngineError, match="needs leader_addr and leader_port"):
        engines.build(_start("sglang", tp=16, nnodes=2, leader_addr=""), version="0.5.2")


def test_sglang_single_and_multinode():
    assert engines.build(_start("sglang", tp=8), version="0.5.2").argv == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/Llama-3.3-70B-Instruct",
        "--host", "0.0.0.0", "--port", "8001", "--served-model-name", "llama-3.3-70b",
        "--enable-metrics", "--tp-size", "8",
        "--max-model-len", "32768",
    ]  # fmt: skip
    worker = engines.build(_start("sglang", tp=16, pp=2, nnodes=2, rank=1, args=[]), version="0.5.2")
    assert worker.argv == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/Llama-3.3-70B-Instruct",
        "--host", "0.0.0.0", "--port", "8001", "--served-model-name", "llama-3.3-70b",
        "--enable-metrics", "--tp-size", "16", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.11:29500",
    ]  # fmt: skip
    assert worker.health_path is None


@pytest.mark.parametrize("version", ["0.4.5", "0.4.6", "0.4.6.post1"])
def test_sglang_before_0_4_6_post2_has_no_pp(version):
    with pytest.raises(
        engines.EngineError, match=rf"sglang {version} has no pipeline parallelism \(needs >= 0\.4\.6\.post2\)"
    ):
        engines.build(_start("sglang", tp=8, pp=2), version=version)


@pytest.mark.parametrize("version", ["0.4.6.post2", "0.4.7", "0.5.23", ""])
def test_sglang_from_0_4_6_post2_has_pp(version):
    argv = engines.build(_start("sglang", tp=8, pp=2, args=[]), version=version).argv
    assert argv[-4:] == ["--tp-size", "8", "--pp-size", "2"]


def test_an_untagged_vllm_source_build_spans_nodes():
    # vLLM built from a checkout without tags calls itself 0.1.devN: its age is unknown, so it is
    # read as the newest (as the gateway reads it), not as 0.1 refused multi-node.
    argv = engines.build(_start("vllm", nnodes=2, rank=0), version="0.1.dev20051+g487ecf187").argv
    assert "--nnodes" in argv


def test_llama_server():
    start = _start("llama.cpp", model_path="/models/qwen2.5-7b-q4_k_m.gguf", args=["-c", "8192"], gpu_indices=[3])
    assert engines.build(start, version="b6500").argv == [
        "llama-server", "-m", "/models/qwen2.5-7b-q4_k_m.gguf",
        "--host", "0.0.0.0", "--port", "8001", "--alias", "llama-3.3-70b", "--metrics",
        "--n-gpu-layers", "999",
        "-c", "8192",
    ]  # fmt: skip
    cpu = _start("llama-server", model_path="/m.gguf", args=[], gpu_indices=[])
    assert engines.build(cpu).argv == [
        "llama-server",
        "-m",
        "/m.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--alias",
        "llama-3.3-70b",
        "--metrics",
    ]
    with pytest.raises(engines.EngineError, match="llama-server runs on one node"):
        engines.build(_start("llama-server", nnodes=2), version="b6500")


def test_llama_server_refuses_a_served_name_with_a_comma():
    start = _start("llamacpp", model_path="/m.gguf", args=[])
    start.profile.served_model_name = "qwen,coder"
    with pytest.raises(engines.EngineError, match=r"cannot serve the name 'qwen,coder': its --alias splits on commas"):
        engines.build(start, version="b6500")
    # Other engines take the name whole.
    vllm = start.model_copy(update={"profile": start.profile.model_copy(update={"engine": "vllm"})})
    assert engines.build(vllm).argv[7:9] == ["--served-model-name", "qwen,coder"]


def test_echo():
    start = _start("echo", args=["--load-seconds", "2"], model_path="")
    assert engines.build(start, python="/venv/bin/python").argv == [
        "/venv/bin/python", "-m", "llmgw_sim.echo", "--host", "127.0.0.1", "--port", "8001",
        "--served-model-name", "llama-3.3-70b", "--load-seconds", "2",
    ]  # fmt: skip


def test_a_model_path_with_spaces_stays_one_argument():
    argv = engines.build(_start("vllm", model_path="/models/my model; rm -rf /")).argv
    assert argv[2] == "/models/my model; rm -rf /"


def test_secret_flag_values_are_masked_for_the_log_only():
    args = [
        "--api-key", "sk-live-123", "--hf-token=hf_abc", "--HF_TOKEN", "hf_def", "--admin-api-key", "adm",
        "--db-password=pw", "--client-secret", "cs", "--apikey", "k2",
        "--max-num-batched-tokens", "8192", "--tokenizer", "/models/tok", "--ssl-keyfile", "/etc/k.pem",
        "--return-tokens-as-token-ids", "--max-model-len", "32768",
    ]  # fmt: skip
    launch = engines.build(_start("vllm", args=args))
    assert launch.argv[-len(args) :] == args
    assert engines.loggable_argv(launch.argv)[-len(args) :] == [
        "--api-key", "***", "--hf-token=***", "--HF_TOKEN", "***", "--admin-api-key", "***",
        "--db-password=***", "--client-secret", "***", "--apikey", "***",
        "--max-num-batched-tokens", "8192", "--tokenizer", "/models/tok", "--ssl-keyfile", "/etc/k.pem",
        "--return-tokens-as-token-ids", "--max-model-len", "32768",
    ]  # fmt: skip
    assert engines.loggable_argv(launch.argv)[: -len(args)] == launch.argv[: -len(args)]
    # A secret flag last, with no value, masks nothing and keeps its place.
    assert engines.loggable_argv(["vllm", "--api-key"]) == ["vllm", "--api-key"]


def test_unknown_engine():
    with pytest.raises(engines.EngineError, match="unknown engine 'tgi'"):
        engines.build(_start("tgi"))


def test_env_multinode_nvlink_domain():
    start = _start("vllm", gpu_indices=[0, 1, 2, 3], hcas=["mlx5_0", "mlx5_1"], nvlink_domain="c0ffee", nnodes=2)
    start.profile.env = {"VLLM_LOGGING_LEVEL": "DEBUG", "CUDA_VISIBLE_DEVICES": "7", "NCCL_IB_HCA": "mlx5_9"}
    assert engines.build(start, mgmt_interface="eth0").env == {
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "NCCL_SOCKET_IFNAME": "=eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_MNNVL_ENABLE": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # The placement's GPUs and fabric, whatever the profile says.
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
    }


def test_env_single_node_no_fabric():
    start = _start("vllm", gpu_indices=[5], mgmt_interface="bond1")
    assert engines.build(start, mgmt_interface="eth0").env == {
        "NCCL_SOCKET_IFNAME": "=bond1",
        "GLOO_SOCKET_IFNAME": "bond1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "5",
    }
