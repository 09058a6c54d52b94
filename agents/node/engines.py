"""Engine command lines and environments, built from a StartShard and its profile.

Always argv lists, never a shell string: a model path or served name with a
space or a `;` must reach the engine as one argument, not as a command.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from agents import wire

ENGINES = ("vllm", "sglang", "llama-server", "echo")
# Accepted spellings of the engine name in a profile.
ALIASES = {"llama.cpp": "llama-server", "llamacpp": "llama-server", "llama_cpp": "llama-server"}

# vLLM spans nodes without Ray from 0.11 (`--nnodes/--node-rank/--master-addr`,
# workers `--headless`); before that only through a Ray cluster the agent does
# not manage.
VLLM_MP_MULTINODE = (0, 11)
# SGLang's pipeline parallelism (`--pp-size`) arrived in 0.4.8.
SGLANG_PP = (0, 4, 8)

# The placement decides these; a profile's env must not quietly override them,
# or a shard would run on GPUs or adapters another shard holds.
PLACEMENT_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA")

BIND_HOST = "0.0.0.0"

# A flag whose name ends in one of these words carries a secret (`--api-key`,
# `--hf-token`, `--admin-api-key`, `--db-password`): its value is masked in
# what the agent logs. "tokens" is not one: it counts tokens in every engine's
# flags (`--max-num-batched-tokens`), and nor is `--tokenizer` or `--ssl-keyfile`.
_SECRET_FLAG = re.compile(r"^--?[\w-]*?(key|token|secret|password|passwd)$", re.I)
MASK = "***"


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
    """`argv` with the value of each secret-carrying flag masked, for the shard log (never for running).

    Both forms: `--api-key X` masks the argument after the flag, `--api-key=X`
    what follows the "=".
    """
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if _SECRET_FLAG.match(flag):
            out.append(f"{flag}={MASK}" if eq else arg)
            mask_next = not eq
        else:
            out.append(arg)
    return out


def engine_name(profile: wire.EngineProfile) -> str:
    """The canonical engine name of a profile."""
    name = profile.engine.strip().lower()
    return ALIASES.get(name, name)


def version_tuple(version: str) -> tuple[int, ...]:
    """ "0.11.0rc1" -> (0, 11, 0); "b6500" -> (6500,); "" -> () (unknown: assume the newest)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _newer_or_unknown(version: str, floor: tuple[int, ...]) -> bool:
    v = version_tuple(version)
    return not v or v >= floor


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
                f"multi-node shards need vllm >= {'.'.join(map(str, VLLM_MP_MULTINODE))}"
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
    argv += ["--tp", str(p.tp), "--enable-metrics"]
    if p.pp > 1:
        if not _newer_or_unknown(version, SGLANG_PP):
            raise EngineError(f"shard {start.shard_id}: sglang {version} has no pipeline parallelism (needs >= 0.4.8)")
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
    argv = ["llama-server", "-m", p.model_path, "--host", BIND_HOST, "--port", str(start.http_port)]
    # llama-server serves /metrics only when asked; the gateway routes by its load.
    argv += ["--alias", _served_name(start), "--metrics"]
    if start.gpu_indices:
        # Every layer on the GPUs it was given; llama.cpp splits across all visible ones.
        argv += ["--n-gpu-layers", "999"]
    return Launch(argv=argv + list(p.args))


def _echo(start: wire.StartShard, python: str) -> Launch:
    p = start.profile
    argv = [python, "-m", "agents.node.echo", "--host", "127.0.0.1", "--port", str(start.http_port)]
    argv += ["--served-model-name", _served_name(start)]
    return Launch(argv=argv + list(p.args))


def shard_env(start: wire.StartShard, *, mgmt_interface: str = "") -> dict[str, str]:
    """The environment a shard adds to the agent's: its GPUs, its fabric's HCAs, its interfaces."""
    env = {str(k): str(v) for k, v in start.profile.env.items()}
    iface = start.mgmt_interface or mgmt_interface
    if iface:
        # NCCL matches interface and HCA names by prefix unless given "=":
        # "eth1" would also pick eth10, "mlx5_1" also mlx5_10..mlx5_17.
        env.setdefault("NCCL_SOCKET_IFNAME", f"={iface}")
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
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
    start: wire.StartShard, *, version: str = "", mgmt_interface: str = "", python: str = sys.executable
) -> Launch:
    """The argv, environment and health path to start one shard."""
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
    return Launch(argv=launch.argv, env=shard_env(start, mgmt_interface=mgmt_interface), health_path=launch.health_path)
