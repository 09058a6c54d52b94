"""Each engine's command line for one shard, built from a StartShard and the engine's version.

Always argv lists, never a shell string: a model path or served name with a
space or a `;` must reach the engine as one argument, not as a command.
Which flags each release has is checked against the releases themselves
(tests/fixtures/engines/flags/, read from the published wheels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmgw_wire.commands import StartShard
from llmgw_wire.engines.versions import Version, dotted

BIND_HOST = "0.0.0.0"

# vLLM spans nodes without Ray from 0.11.1 (`--nnodes/--node-rank/--master-addr/
# --master-port`, workers `--headless`): 0.11.0 has none of the first four (its
# `--headless` serves multi-node data parallelism only) and dies on them as
# unrecognized arguments. Before that only through a Ray cluster the agent does
# not manage. The releases' own flags prove it (tests/fixtures/engines/flags/).
VLLM_MP_MULTINODE = (0, 11, 1)
# SGLang's pipeline parallelism (`--pp-size`) arrived in 0.4.6.post2: a
# release key (major, minor, patch, post) says so, where a plain
# version_tuple cannot tell 0.4.6 from 0.4.6.post2.
SGLANG_PP = (0, 4, 6, 2)


class EngineError(ValueError):
    """The shard cannot be started with this engine (unknown engine, unsupported shape)."""


@dataclass(frozen=True)
class Launch:
    """How to start one shard: argv, the environment it adds, and where its health is."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # None: this rank serves no HTTP (a multi-node worker); up means ready.
    health_path: str | None = "/health"


def served_name(start: StartShard) -> str:
    """The model name the shard answers to."""
    p = start.profile
    return p.served_model_name or p.name or p.model_path or start.replica_id


def _leader(start: StartShard) -> tuple[str, int]:
    if not start.leader_addr or not start.leader_port:
        raise EngineError(f"shard {start.shard_id}: a {start.nnodes}-node shard needs leader_addr and leader_port")
    return start.leader_addr, start.leader_port


def vllm(start: StartShard, version: Version, *, python: str) -> Launch:
    """`vllm serve` for one shard; a worker rank of a multi-node shard runs headless."""
    # vLLM serves /metrics by default: nothing to turn on for the gateway.
    p = start.profile
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: vllm needs the profile's model_path")
    argv = ["vllm", "serve", p.model_path, "--host", BIND_HOST, "--port", str(start.http_port)]
    argv += ["--served-model-name", served_name(start)]
    argv += ["--tensor-parallel-size", str(p.tp), "--pipeline-parallel-size", str(p.pp)]
    health: str | None = "/health"
    if start.nnodes > 1:
        if not version.at_least(VLLM_MP_MULTINODE):
            raise EngineError(
                f"shard {start.shard_id}: vllm {version.text} spans nodes only through Ray; "
                f"multi-node shards need vllm >= {dotted(VLLM_MP_MULTINODE)}"
            )
        addr, port = _leader(start)
        argv += ["--nnodes", str(start.nnodes), "--node-rank", str(start.rank)]
        argv += ["--master-addr", addr, "--master-port", str(port)]
        if start.rank > 0:
            argv.append("--headless")
            health = None
    return Launch(argv=argv + list(p.args), health_path=health)


def sglang(start: StartShard, version: Version, *, python: str) -> Launch:
    """`python3 -m sglang.launch_server` for one shard; only node rank 0 serves HTTP."""
    p = start.profile
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: sglang needs the profile's model_path")
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", p.model_path]
    argv += ["--host", BIND_HOST, "--port", str(start.http_port), "--served-model-name", served_name(start)]
    # SGLang serves /metrics only when asked; the gateway routes by its queue and cache.
    argv += ["--enable-metrics"]
    # The full name: SGLang has no `--tp`, only argparse's abbreviation of
    # `--tp-size`, which breaks the day another `--tp...` flag appears.
    argv += ["--tp-size", str(p.tp)]
    if p.pp > 1:
        if not version.at_least(SGLANG_PP):
            raise EngineError(
                f"shard {start.shard_id}: sglang {version.text} has no pipeline parallelism "
                f"(needs >= {dotted(SGLANG_PP)})"
            )
        argv += ["--pp-size", str(p.pp)]
    health: str | None = "/health"
    if start.nnodes > 1:
        addr, port = _leader(start)
        argv += ["--nnodes", str(start.nnodes), "--node-rank", str(start.rank), "--dist-init-addr", f"{addr}:{port}"]
        if start.rank > 0:
            health = None
    return Launch(argv=argv + list(p.args), health_path=health)


def llamacpp(start: StartShard, version: Version, *, python: str) -> Launch:
    """`llama-server` for one shard: one node, one process, every layer on its GPUs when it has any."""
    p = start.profile
    if start.nnodes > 1 or p.pp > 1:
        raise EngineError(
            f"shard {start.shard_id}: llama-server runs on one node (its multi-host mode is RPC, not managed here)"
        )
    if not p.model_path:
        raise EngineError(f"shard {start.shard_id}: llama-server needs the profile's model_path (a .gguf file)")
    name = served_name(start)
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


def echo(start: StartShard, version: Version, *, python: str) -> Launch:
    """The test engine, run by the agent's own interpreter on loopback."""
    argv = [python, "-m", "llmgw_sim.echo", "--host", "127.0.0.1", "--port", str(start.http_port)]
    argv += ["--served-model-name", served_name(start)]
    return Launch(argv=argv + list(start.profile.args))


def _flag_int(args: list[str], *names: str) -> int | None:
    """The integer value of the last of `names` in args (`--x 4` or `--x=4`), None when absent or not a number."""
    found: int | None = None
    for i, a in enumerate(args):
        for n in names:
            value = None
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1 :]
            if value is not None:
                try:
                    found = int(value)
                except ValueError:
                    return None
    return found


def sglang_ports_after(engine_args: Sequence[str]) -> int:
    """Ports SGLang binds right after its HTTP port: with data-parallel attention, 5 plus one per dp rank.

    Data-parallel attention is `--enable-dp-attention` with `--dp-size` (also spelled
    `--data-parallel-size`, or `--dp` by argparse's abbreviation), or, from 0.5.x,
    `--attn-dp-size` / `--attention-data-parallel-size` above 1.
    """
    args = [str(a) for a in engine_args]
    attn_dp = _flag_int(args, "--attn-dp-size", "--attention-data-parallel-size") or 0
    if attn_dp > 1:
        return 5 + attn_dp
    if "--enable-dp-attention" not in args:
        return 0
    dp = _flag_int(args, "--dp-size", "--data-parallel-size", "--dp") or 1
    return 5 + dp


def no_ports_after(engine_args: Sequence[str]) -> int:
    """An engine that binds only its HTTP port."""
    return 0
