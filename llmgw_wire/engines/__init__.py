"""The engine registry: names, probes, versions, command lines, ports and metrics of each engine (no Django)."""

from llmgw_wire.engines.launch import BIND_HOST, SGLANG_PP, VLLM_MP_MULTINODE, EngineError, Launch, served_name
from llmgw_wire.engines.metrics import EngineLoad, Names
from llmgw_wire.engines.registry import (
    ENGINES,
    Engine,
    Probe,
    UnknownEngine,
    canonical,
    canonical_versions,
    engine_load,
    get,
    metric_names,
    parallelism_problems,
    probe_version,
)
from llmgw_wire.engines.versions import Version, dotted, llamacpp_build, python_release

__all__ = [
    "BIND_HOST",
    "ENGINES",
    "SGLANG_PP",
    "VLLM_MP_MULTINODE",
    "Engine",
    "EngineError",
    "EngineLoad",
    "Launch",
    "Names",
    "Probe",
    "UnknownEngine",
    "Version",
    "canonical",
    "canonical_versions",
    "dotted",
    "engine_load",
    "get",
    "llamacpp_build",
    "metric_names",
    "parallelism_problems",
    "probe_version",
    "python_release",
    "served_name",
]
