"""A shard's command line and environment on this node: the engine registry's argv plus what the placement decided.

The argv of each engine lives in the engine registry (`llmgw_wire.engines`), shared
with the control plane; this module adds the node's side: the cards, adapters
and interfaces the shard was given, and the interpreter that runs the echo engine.
"""

from __future__ import annotations

import importlib.util
import sys

import llmgw_wire as wire
from llmgw_wire import engines as wire_engines
from llmgw_wire.engines import EngineError, Launch

__all__ = ["EngineError", "Launch", "build", "engine_name", "loggable_argv", "shard_env"]


def loggable_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of each secret-carrying flag masked, for the shard log (never for running)."""
    return wire.mask_args(argv)


def engine_name(profile: wire.EngineProfile) -> str:
    """The canonical engine name of a profile; EngineError naming the known ones when no engine goes by it."""
    return wire_engines.get(profile.engine).name


def shard_env(start: wire.StartShard, *, mgmt_interface: str = "", host_ip: str = "") -> dict[str, str]:
    """The environment a shard adds to the agent's: its GPUs, its fabric's HCAs, its interfaces.

    `host_ip` is the address of the shard's interface on this node ("" when
    unknown).
    """
    engine = wire_engines.get(start.profile.engine)
    env = {str(k): str(v) for k, v in start.profile.env.items()}
    iface = start.mgmt_interface or mgmt_interface
    if iface:
        # NCCL matches interface and HCA names by prefix unless given "=":
        # "eth1" would also pick eth10, "mlx5_1" also mlx5_10..mlx5_17.
        env.setdefault("NCCL_SOCKET_IFNAME", f"={iface}")
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
    if start.nnodes > 1 and host_ip:
        # vLLM and SGLang advertise the address of the default route's interface
        # unless told: where management and data networks differ, the other
        # ranks would dial an address that is not the shard's.
        for name in engine.host_ip_env:
            env.setdefault(name, host_ip)
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
    try:
        engine = wire_engines.get(start.profile.engine)
    except EngineError as e:
        raise EngineError(f"shard {start.shard_id}: {e}") from e
    if engine.name == "echo" and importlib.util.find_spec("llmgw_sim") is None:
        # The echo engine is llmgw's stand-in for vLLM in development; GPU nodes get the agent alone.
        raise EngineError(
            f"shard {start.shard_id}: the echo engine is a development tool (llmgw_sim, in llmgw's source) "
            "and this node's agent was installed without it: deploy a real engine, or run the agent from a checkout"
        )
    launch = engine.launch(start, version=version, python=python)
    env = shard_env(start, mgmt_interface=mgmt_interface, host_ip=host_ip)
    return Launch(argv=launch.argv, env=env, health_path=launch.health_path)
