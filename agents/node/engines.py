"""Engine command lines and environments, built from a StartShard and its profile.

Always argv lists, never a shell string: a model path or served name with a
space or a `;` must reach the engine as one argument, not as a command.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import wire

ENGINES = ("vllm", "sglang", "llama-server", "echo")
# Accepted spellings of the engine name in a profile.
ALIASES = {"llama.cpp": "llama-server", "llamacpp": "llama-server", "llama_cpp": "llama-server"}

# vLLM spans nodes without Ray from 0.11.1 (`--nnodes/--node-rank/--master-addr/
# --master-port`, workers `--headless`): 0.11.0 has none of these flags and
# dies on them as unrecognized arguments. Before that only through a Ray
# cluster the agent does not manage.
VLLM_MP_MULTINODE = (0, 11, 1)
# SGLang's pipeline parallelism (`--pp-size`) arrived in 0.4.6.post2: a
# release key (major, minor, patch, post) says so, where a plain
# version_tuple cannot tell 0.4.6 from 0.4.6.post2.
SGLANG_PP = (0, 4, 6, 2)

# The placement decides these; a profile's env must not quietly override them,
# or a shard would run on GPUs or adapters another shard holds.
PLACEMENT_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA")

BIND_HOST = "0.0.0.0"

# Secret-carrying flags are decided by name in the wire module, which the
# control plane shares: what the agent masks in its log, the API never shows.
MASK = wire.MASK


class EngineError(ValueError):
    """The shard cannot be started with this engine (unknown engine, unsupported shape)."""


@dataclass(frozen=True)
class Launch:
    """How to start one shard: argv, the environment it adds, and where its health is."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # None: this rank serves no HTTP (a multi-node worker); up means ready.
    health_path: str | None = "/health"


def loggable_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of each secret-carrying flag masked, for the shard log (never for running)."""
    return wire.mask_args(argv)


def engine_name(profile: wire.EngineProfile) -> str:
    """The canonical engine name of a profile."""
    name = profile.engine.strip().lower()
    return ALIASES.get(name, name)


def version_tuple(version: str) -> tuple[int, ...]:
    """ "0.11.0rc1" -> (0, 11, 0); "b6500" -> (6500,); "" -> () (unknown: assume the newest)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


_POST = re.compile(r"\.?post(\d+)", re.I)


def release_key(version: str) -> tuple[int, int, int, int]:
    """ "0.4.6.post2" -> (0, 4, 6, 2); "0.11.0rc1" -> (0, 11, 0, 0); "" -> (0, 0, 0, 0).

    The post-release number is what a floor such as SGLang's 0.4.6.post2
    needs; a missing part counts as 0.
    """
    head = version.split("+")[0]
    parts = [*version_tuple(head), 0, 0, 0]
    post = _POST.search(head)
    return parts[0], parts[1], parts[2], int(post.group(1)) if post else 0


def _newer_or_unknown(version: str, floor: tuple[int, ...]) -> bool:
    if not version_tuple(version):
        return True
    return release_key(version) >= tuple(floor) + (0,) * (4 - len(floor))


def _dotted(floor: tuple[int, ...]) -> str:
    """A floor as its release is spelled: (0, 4, 6, 2) -> "0.4.6.post2", (0, 11, 1) -> "0.11.1"."""
    base = ".".join(map(str, floor[:3]))
    return f"{base}.post{floor[3]}" if len(floor) > 3 and floor[3] else base


def _served_name(start: wire.StartShard) -> str:
    p = start.profile
    return p.served_model_name or p.name or p.model_path or start.replica_id


def _leader(start: wire.StartShard) -> tuple[str, int]:
    if not start.leader_addr or not start.leader_port:
        raise EngineError(f"shard {start.shard_id}: a {start.nnodes}-node shard needs leader_addr and leader_port")
    return start.leader_addr, start.leader_port


def _vllm(start: wire.StartShard, version: str) -> Launch:
    # vLLM serves /metrics by default: nothing to turn on for the gateway.
    p = start.profile
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: vllm needs the profile's model_path")
    argv = ["vllm", "serve", p.model_path, "--host", BIND_HOST, "--port", str(start.http_port)]
    argv += ["--served-model-name", _served_name(start)]
    argv += ["--tensor-parallel-size", str(p.tp), "--pipeline-parallel-size", str(p.pp)]
    health: str | None = "/health"
    if start.nnodes > 1:
        if not _newer_or_unknown(version, VLLM_MP_MULTINODE):
            raise EngineError(
                f"shard {start.shard_id}: vllm {version} spans nodes only through Ray; "
                f"multi-node shards need vllm >= {_dotted(VLLM_MP_MULTINODE)}"
            )
        addr, port = _leader(start)
        argv += ["--nnodes", str(start.nnodes), "--node-rank", str(start.rank)]
        argv += ["--master-addr", addr, "--master-port", str(port)]
        if start.rank > 0:
            argv.append("--headless")
            health = None
    return Launch(argv=argv + list(p.args), health_path=health)


def _sglang(start: wire.StartShard, version: str) -> Launch:
    p = start.profile
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: sglang needs the profile's model_path")
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", p.model_path]
    argv += ["--host", BIND_HOST, "--port", str(start.http_port), "--served-model-name", _served_name(start)]
    # SGLang serves /metrics only when asked; the gateway routes by its queue and cache.
    argv += ["--enable-metrics"]
    # The full name: SGLang has no `--tp`, only argparse's abbreviation of
    # `--tp-size`, which breaks the day another `--tp...` flag appears.
    argv += ["--tp-size", str(p.tp)]
    if p.pp > 1:
        if not _newer_or_unknown(version, SGLANG_PP):
            raise EngineError(
                f"shard {start.shard_id}: sglang {version} has no pipeline parallelism (needs >= {_dotted(SGLANG_PP)})"
            )
        argv += ["--pp-size", str(p.pp)]
    health: str | None = "/health"
    if start.nnodes > 1:
        addr, port = _leader(start)
        argv += ["--nnodes", str(start.nnodes), "--node-rank", str(start.rank), "--dist-init-addr", f"{addr}:{port}"]
        if start.rank > 0:
            # Only node rank 0 serves HTTP.
            health = None
    return Launch(argv=argv + list(p.args), health_path=health)


def _llama_server(start: wire.StartShard) -> Launch:
    p = start.profile
    if start.nnodes > 1 or p.pp > 1:
        raise EngineError(
            f"shard {start.shard_id}: llama-server runs on one node (its multi-host mode is RPC, not managed here)"
        )
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: llama-server needs the profile's model_path (a .gguf file)")
    name = _served_name(start)
    if "," in name:
        # llama-server splits --alias on commas: "a,b" would serve two names, neither the one asked for.
        raise EngineError(
            f"shard {start.shard_id}: llama-server cannot serve the name {name!r}: its --alias splits on commas"
        )
    argv = ["llama-server", "-m", p.model_path, "--host", BIND_HOST, "--port", str(start.http_port)]
    # llama-server serves /metrics only when asked; the gateway routes by its load.
    argv += ["--alias", name, "--metrics"]
    if start.gpu_indices:
        # Every layer on the GPUs it was given; llama.cpp splits across all visible ones.
        argv += ["--n-gpu-layers", "999"]
    return Launch(argv=argv + list(p.args))


def _echo(start: wire.StartShard, python: str) -> Launch:
    p = start.profile
    argv = [python, "-m", "agents.node.echo", "--host", "127.0.0.1", "--port", str(start.http_port)]
    argv += ["--served-model-name", _served_name(start)]
    return Launch(argv=argv + list(p.args))


def shard_env(start: wire.StartShard, *, mgmt_interface: str = "", host_ip: str = "") -> dict[str, str]:
    """The environment a shard adds to the agent's: its GPUs, its fabric's HCAs, its interfaces.

    `host_ip` is the address of the shard's interface on this node ("" when
    unknown).
    """
    env = {str(k): str(v) for k, v in start.profile.env.items()}
    iface = start.mgmt_interface or mgmt_interface
    if iface:
        # NCCL matches interface and HCA names by prefix unless given "=":
        # "eth1" would also pick eth10, "mlx5_1" also mlx5_10..mlx5_17.
        env.setdefault("NCCL_SOCKET_IFNAME", f"={iface}")
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
    if start.nnodes > 1 and host_ip and engine_name(start.profile) == "vllm":
        # vLLM advertises the address of the default route's interface unless
        # told: where management and data networks differ, the other ranks
        # would dial an address that is not the shard's.
        env.setdefault("VLLM_HOST_IP", host_ip)
    if start.nvlink_domain:
        env.setdefault("NCCL_MNNVL_ENABLE", "1")
    # CUDA's default order is fastest-first, NVML's and nvidia-smi's is PCI:
    # without this, index 3 to the placement is another card to the engine.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in start.gpu_indices)
    if start.hcas:
        # Only this replica's fabric: NCCL handed an adapter on a second fabric
        # picks a peer it cannot reach and hangs instead of failing.
        env["NCCL_IB_HCA"] = "=" + ",".join(start.hcas)
    else:
        env.pop("NCCL_IB_HCA", None)
    return env


def build(
    start: wire.StartShard,
    *,
    version: str = "",
    mgmt_interface: str = "",
    host_ip: str = "",
    python: str = sys.executable,
) -> Launch:
    """The argv, environment and health path to start one shard (`host_ip`: the address of its interface)."""
    name = engine_name(start.profile)
    if name == "vllm":
        launch = _vllm(start, version)
    elif name == "sglang":
        launch = _sglang(start, version)
    elif name == "llama-server":
        launch = _llama_server(start)
    elif name == "echo":
        launch = _echo(start, python)
    else:
        raise EngineError(
            f"shard {start.shard_id}: unknown engine {start.profile.engine!r} (known: {', '.join(ENGINES)})"
        )
    env = shard_env(start, mgmt_interface=mgmt_interface, host_ip=host_ip)
    return Launch(argv=launch.argv, env=env, health_path=launch.health_path)
