"""The engines llmgw runs: one entry each, read by the node agent and the control plane alike.

Each entry says the engine's canonical name (what profiles, node inventories
and commands carry) and the other names it goes by, how to probe it and on
which stream it answers, how to read its version, what each version can do,
how to start a shard of it, which ports it binds and which metrics it serves.
Two layers that each kept their own list once disagreed: discovery reported
`llama-server`, profiles said `llamacpp`, placement asked a node to install an
engine it had, and every llama.cpp deployment was refused on every real node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw_wire.commands import StartShard
from llmgw_wire.engines import launch, metrics
from llmgw_wire.engines.versions import Version, llamacpp_build, python_release


@dataclass(frozen=True)
class Probe:
    """How discovery asks an installed engine its version."""

    argv: tuple[str, ...]
    # llama-server prints its version on stderr (common/arg.cpp's --version), stdout stays empty.
    stream: Literal["stdout", "stderr"]
    # The recording's name in a hardware profile (tools.recording_name would make a poor one of `python -c`).
    record: str
    # Only lines starting with this carry the version ("" = the first line that parses).
    line_prefix: str = ""


@dataclass(frozen=True)
class Engine:
    """One inference engine as every layer of llmgw knows it."""

    name: str
    label: str
    aliases: tuple[str, ...]
    probe: Probe | None
    read_version: Callable[[str], Version]
    build: Callable[..., launch.Launch]
    names: Callable[[Version], metrics.Names]
    # Ports bound right after the HTTP port, from the profile's args (reserved with it).
    ports_after: Callable[[Sequence[str]], int] = launch.no_ports_after
    multi_node: bool = False
    # Where the engine reads the address it advertises to its other ranks.
    host_ip_env: tuple[str, ...] = ()
    # Shipped with the agent: always installed, never probed.
    builtin: bool = False
    # Each tensor x pipeline rank is one process on one GPU, so tp x pp must be every GPU the
    # replica holds (llama.cpp splits layers over whatever it is given; echo uses none).
    rank_per_gpu: bool = False

    def version(self, text: str) -> Version:
        """`text` (a probe's output line or a stored version) read as this engine's version."""
        return self.read_version(text)

    def launch(self, start: StartShard, *, version: str = "", python: str = "python3") -> launch.Launch:
        """The argv and health path of one shard (the environment is the agent's to add)."""
        return self.build(start, self.version(version), python=python)

    def metric_names(self, version: str) -> metrics.Names:
        """The names this engine serves its figures under at `version`."""
        return self.names(self.version(version))


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            name="vllm",
            label="vLLM",
            aliases=("vllm",),
            probe=Probe(argv=("vllm", "--version"), stream="stdout", record="vllm_--version"),
            read_version=python_release,
            build=launch.vllm,
            names=metrics.vllm_names,
            multi_node=True,
            host_ip_env=("VLLM_HOST_IP",),
            rank_per_gpu=True,
        ),
        Engine(
            name="sglang",
            label="SGLang",
            aliases=("sglang", "sgl"),
            probe=Probe(
                argv=("python3", "-c", "import sglang; print(sglang.__version__)"),
                stream="stdout",
                record="sglang_version",
            ),
            read_version=python_release,
            build=launch.sglang,
            names=lambda v: metrics.SGLANG,
            ports_after=launch.sglang_ports_after,
            multi_node=True,
            # sglang.srt.utils.get_ip reads SGLANG_HOST_IP, then HOST_IP.
            host_ip_env=("SGLANG_HOST_IP", "HOST_IP"),
            rank_per_gpu=True,
        ),
        Engine(
            name="llamacpp",
            label="llama.cpp",
            aliases=("llama.cpp", "llama-server", "llama_cpp", "llama-cpp"),
            probe=Probe(
                argv=("llama-server", "--version"),
                stream="stderr",
                record="llama-server_--version",
                line_prefix="version",
            ),
            read_version=llamacpp_build,
            build=launch.llamacpp,
            names=lambda v: metrics.LLAMACPP,
        ),
        Engine(
            name="echo",
            label="echo (test engine)",
            aliases=("echo",),
            probe=None,
            read_version=python_release,
            build=launch.echo,
            names=lambda v: metrics.VLLM_NEW,
            # It stands in for vLLM in simulations, multi-node shapes included, but holds no GPU itself.
            multi_node=True,
            builtin=True,
        ),
    )
}
_BY_ALIAS = {alias: e.name for e in ENGINES.values() for alias in (e.name, *e.aliases)}


class UnknownEngine(launch.EngineError):
    """No engine goes by this name."""


def canonical(name: str) -> str:
    """The engine's canonical name for any name it goes by ("llama-server" -> "llamacpp"); "" when unknown."""
    return _BY_ALIAS.get(name.strip().lower(), "")


def get(name: str) -> Engine:
    """The engine going by `name`, or UnknownEngine naming the known ones."""
    canon = canonical(name)
    if not canon:
        raise UnknownEngine(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return ENGINES[canon]


def canonical_versions(versions: dict[str, str]) -> dict[str, str]:
    """A node's engine -> version map under canonical names (an older agent reports `llama-server`).

    Names no engine goes by are kept as they are: an inventory reports what
    the node has, and a newer agent may know an engine this control plane does not.
    """
    out: dict[str, str] = {}
    for name, version in versions.items():
        out[canonical(name) or name] = version
    return out


def probe_version(engine: Engine, stdout: str, stderr: str) -> Version:
    """The version in a probe's output, read from the stream the engine prints it on."""
    if engine.probe is None:
        return Version()
    text = stderr if engine.probe.stream == "stderr" else stdout
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("INFO", "WARNING", "DEBUG")):
            continue
        if engine.probe.line_prefix and not line.lower().startswith(engine.probe.line_prefix):
            continue
        v = engine.version(line)
        if v.text:
            return v
    return Version()


def metric_names(engine: str, version: str) -> metrics.Names:
    """The names `engine` at `version` serves its figures under; an engine no one knows is read with vLLM's."""
    canon = canonical(engine)
    return ENGINES[canon].metric_names(version) if canon else metrics.VLLM_NEW


def engine_load(engine: str, version: str, text: str) -> metrics.EngineLoad | None:
    """An engine's requests, cache use and hit ratio from one scrape of its /metrics."""
    return metrics.parse(text, metric_names(engine, version))


def parallelism_problems(engine: str, *, tp: int, pp: int, nodes: int, gpus_per_node: int) -> dict[str, str]:
    """Why a profile's parallelism cannot run, by field ({} when it can).

    An engine that runs one rank per GPU needs tp x pp = nodes x GPUs per node:
    with fewer GPUs the engine dies asking for ranks it has no card for; with
    more, cards are claimed and left idle. GPUs per node 0 means "derive it".
    """
    canon = canonical(engine)
    if not canon:
        return {}
    e = ENGINES[canon]
    problems: dict[str, str] = {}
    if nodes > 1 and not e.multi_node:
        problems["nodes"] = f"{e.label} runs on one node; nodes is {nodes}"
    if e.rank_per_gpu and gpus_per_node and tp * pp != nodes * gpus_per_node:
        problems["gpus_per_node"] = (
            f"{e.label} runs tp x pp = {tp} x {pp} = {tp * pp} ranks, one per GPU, but nodes x gpus_per_node "
            f"= {nodes} x {gpus_per_node} = {nodes * gpus_per_node}"
        )
    if e.rank_per_gpu and not gpus_per_node and (tp * pp) % nodes:
        problems["nodes"] = f"{e.label} spreads tp x pp = {tp * pp} ranks evenly over nodes; {nodes} nodes cannot"
    return problems
