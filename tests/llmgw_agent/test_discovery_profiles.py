import subprocess
import sys
from types import SimpleNamespace

import llmgw_wire as wire
from inventory.gpus import imex_up, node_domain
from llmgw_agent.discovery import discover, gpu_fabrics, ibnetdiscover, nvml, run_tool, sample
from llmgw_agent.discovery.tools import recording_name

from .conftest import PROFILES, REPO


def _domain(gpus):
    return node_domain(
        SimpleNamespace(
            fabric_state=g.fabric.state if g.fabric else "",
            fabric_status=g.fabric.status if g.fabric else "",
            cluster_uuid=g.fabric.cluster_uuid if g.fabric else "",
            clique_id=g.fabric.clique_id if g.fabric else "",
        )
        for g in gpus
    )


def test_gb200_tray_in_a_domain_with_imex():
    d = discover(root=PROFILES / "gb200-nvl", model_dirs=["/models", "/shared"])
    assert [g.name for g in d.gpus] == ["NVIDIA GB200"] * 4
    assert _domain(d.gpus) == "9c6f5af3-53bf-49b5-a436-b66766c413c3/4026"
    assert d.imex == wire.IMEX(state="UP", channels=1, detail="18/18 nodes ready") and imex_up(d.imex.state)
    assert (d.host.arch, d.host.os_id, d.host.os_version, d.host.nvidia_driver) == (
        "aarch64",
        "ubuntu",
        "24.04",
        "595.58.03",
    )
    assert [(w.path, w.shared) for w in d.weights] == [
        ("/models/Llama-3.1-8B-Instruct", False),
        ("/shared/gguf/qwen2.5-7b-instruct-q4_k_m.gguf", True),
    ]
    assert [(s.path, s.fstype, s.shared, s.free_bytes) for s in d.storage] == [
        ("/models", "xfs", False, 14152990507008),
        ("/shared", "ceph", True, 562949953421312),
    ]
    assert d.engine_versions == {"vllm": "0.11.0"} and d.engines_probed
    assert d.problems == []
    fabrics = gpu_fabrics(root=PROFILES / "gb200-nvl")
    assert [f.fabric.clique_id for f in fabrics] == ["4026"] * 4


def test_hgx_h100_two_fabrics():
    d = discover(root=PROFILES / "hgx-h100", model_dirs=["/raid/models", "/lustre/models"])
    assert len(d.gpus) == 8 and _domain(d.gpus) == ""
    assert d.gpus[0].nic_paths["mlx5_0"] == "PIX" and d.gpus[4].numa_node == 1
    assert d.gpus[0].nvlink_peers == [1, 2, 3, 4, 5, 6, 7]
    assert (d.memory_total_mb, d.cpu_count, d.imex) == (2064005, 192, None)
    s = sample(root=PROFILES / "hgx-h100")
    assert [(p.hca, p.sm_guid, p.rate_gbps) for p in s.ib_ports][::4] == [
        ("mlx5_0", "0x7cfe90030016aef1", 400),
        ("mlx5_4", "0x0002c90200259201", 400),
    ]
    assert {p.sm_guid for p in s.ib_ports[:4]} == {"0x7cfe90030016aef1"}
    assert {p.sm_guid for p in s.ib_ports[4:]} == {"0x0002c90200259201"}
    assert [len(p.sms) for p in s.ib_ports] == [2, 0, 0, 0, 1, 0, 0, 0]
    assert s.ib_ports[0].port_guid == "0xec0d9a0300431464" and s.ib_ports[0].gid_prefix == "fe80:0000:0000:0000"
    assert s.ib_ports[5].counters["link_downed"] == 1
    # XID 31 is the application's fault: counted, not a problem.
    assert (s.gpus[6].wear.xid_errors, s.gpus[6].wear.last_xid, s.gpus[6].problems) == (1, 31, [])


def test_pcie_replay_rate_is_a_problem():
    first = sample(root=PROFILES / "hgx-h100", now=1000.0)
    first.pcie_replays[6] = 5  # ten more replays since, in one minute
    second = sample(root=PROFILES / "hgx-h100", previous=first, now=1060.0)
    assert second.gpus[6].problems == ["10 PCIe replays a minute, past 8: check the slot and riser"]
    assert second.gpus[0].problems == []


def test_roce_node_network_and_cgroup_limits():
    d = discover(root=PROFILES / "roce", model_dirs=["/models"])
    assert (d.cpu_count, d.memory_total_mb) == (64, 393216)
    s = sample(root=PROFILES / "roce")
    assert [(p.hca, p.link_layer, p.netdev, p.network, p.sm_guid) for p in s.ib_ports] == [
        ("mlx5_0", "Ethernet", "ens1f0np0", "192.168.100.0/24", ""),
        ("mlx5_1", "Ethernet", "ens1f1np1", "", ""),
    ]
    # No engine recorded on this machine: an absent engine is not a problem.
    assert d.engine_versions == {} and d.engines_probed


def test_cpu_only_node_reports_what_it_has():
    d = discover(root=PROFILES / "cpu-only", model_dirs=["/srv/models", "/missing"])
    assert (d.gpus, d.imex, d.cpu_count) == ([], None, 48)
    # llama-server prints its version on stderr, nothing on stdout; a tarball build knows no build number.
    assert d.engine_versions == {"llamacpp": "0.6.0-dev"}
    assert d.problems == ["model directory /missing: not found"]
    s = sample(root=PROFILES / "cpu-only")
    assert (s.gpus, s.ib_ports, s.load.load1, s.load.cpu_count) == ([], [], 0.52, 48)


def test_missing_tool_and_timeout_are_problems(tmp_path):
    (tmp_path / "cmd").mkdir()
    (tmp_path / "cmd" / "nvidia-smi_-q.timeout").write_text("")
    assert run_tool(["nvidia-smi", "-q"], root=tmp_path, timeout=1).error == "nvidia-smi: timed out"
    assert run_tool(["sminfo"], root=tmp_path, timeout=1).error == "sminfo: not installed"
    d = discover(root=tmp_path, model_dirs=[])
    assert d.gpus == [] and d.problems == ["nvidia-smi -q: nvidia-smi: timed out"]
    live = run_tool(["llmgw-no-such-tool"], root=None, timeout=1)
    assert (live.ok, live.error) == (False, "llmgw-no-such-tool: not installed")
    slow = run_tool([sys.executable, "-c", "import time; time.sleep(5)"], root=None, timeout=0.2)
    assert slow.ok is False and "timed out after 0.2s" in slow.error
    assert ibnetdiscover(hca="mlx5_0", port=1, timeout=1, root=tmp_path).ok is False
    assert recording_name(["sminfo", "-C", "mlx5_0", "-P", "1"]) == "sminfo_-C_mlx5_0_-P_1"


def test_a_broken_tool_is_a_problem_even_when_its_error_says_not_installed(tmp_path):
    # Only a tool that is absent goes unmentioned; one that runs and fails is reported,
    # whatever words its own error uses.
    (tmp_path / "cmd").mkdir()
    (tmp_path / "cmd" / "vllm_--version.err").write_text("exit 1: ImportError: flash_attn is not installed")
    (tmp_path / "cmd" / "nvidia-smi_topo_-m.err").write_text("exit 9: the NVIDIA driver is not installed")
    (tmp_path / "cmd" / "sglang_version.err").write_text("exit 1: ModuleNotFoundError: No module named 'torch'")
    (tmp_path / "cmd" / "nvidia-smi_-q.txt").write_text(
        (PROFILES / "hgx-h100" / "cmd" / "nvidia-smi_-q.txt").read_text()
    )
    d = discover(root=tmp_path, model_dirs=[])
    assert d.engine_versions == {}
    assert "engine vllm: vllm: exit 1: ImportError: flash_attn is not installed" in d.problems
    assert "nvidia-smi topo -m: nvidia-smi: exit 9: the NVIDIA driver is not installed" in d.problems
    assert "engine sglang: python3: exit 1: ModuleNotFoundError: No module named 'torch'" in d.problems
    (tmp_path / "cmd" / "sglang_version.err").write_text("exit 1: ModuleNotFoundError: No module named 'sglang'")
    assert not any("sglang" in p for p in discover(root=tmp_path, model_dirs=[]).problems)  # simply not installed


def test_nvml_conversion_on_recorded_values():
    raw = {
        "uuid": "GPU-24fb92fc-15ec-deff-a5c1-82b48e063f59",
        "name": "NVIDIA GB200",
        "memory_total": 189471 * 1024 * 1024,
        "power_mw": 181000,
        "compute_capability": (10, 0),
        "throttle_reasons": 0x1 | 0x4,
        "remapped_rows": [0, 0, 1, 0],
        "pids": [4242],
        "fabric": {
            "state": 3,
            "status": 0,
            "cluster_uuid": bytes.fromhex("9c6f5af353bf49b5a436b66766c413c3"),
            "clique_id": 4026,
            "health_mask": 2,
        },
    }
    r = nvml.reading_from_nvml(0, raw, driver="595.58.03", cuda="13.2")
    assert (r.memory_total_mb, r.power_w, r.compute_capability, r.throttle) == (189471, 181.0, "10.0", ["SW Power Cap"])
    assert r.fabric == wire.GPUFabric(
        state="Completed",
        status="Success",
        cluster_uuid="9c6f5af3-53bf-49b5-a436-b66766c413c3",
        clique_id="4026",
        bandwidth="Full",
    )
    assert r.remap_pending and r.processes == [4242]
    assert nvml.fabric_from_nvml({"state": 0}) is None


def test_agent_code_imports_no_django():
    code = "import sys; sys.modules['django'] = None; import llmgw_agent.discovery; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_no_model_directory_configured_means_weights_not_looked_for():
    d = discover(root=PROFILES / "cpu-only", model_dirs=[])
    assert d.weights is None


def test_an_engine_that_answers_on_the_other_stream_is_reported_as_such(tmp_path):
    # A probe read from the wrong stream finds no version: said, not silently absent.
    cmd = tmp_path / "cmd"
    cmd.mkdir()
    (cmd / "llama-server_--version.txt").write_text(
        (PROFILES / "cpu-only" / "cmd" / "llama-server_--version.stderr").read_text()
    )
    d = discover(root=tmp_path, model_dirs=[])
    assert d.engine_versions == {}
    assert "engine llamacpp: llama-server --version printed no version on stderr" in d.problems
