"""The agent's vLLM and SGLang command lines against the flags the engines' releases define.

Each fixture under tests/fixtures/engines/flags/ lists every flag one release's
parser registers, read from its wheel by scripts/engine_flags.py. Every flag the
builder emits must be there by its full name: a flag a release lacks kills the
engine at start ("unrecognized arguments"), and an abbreviation argparse
happens to accept today breaks the day the release adds a second flag with
that prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import llmgw_wire as wire
from llmgw_agent import engines

FLAGS = Path(__file__).resolve().parents[1] / "fixtures" / "engines" / "flags"
HEADER = re.compile(r"# (?P<engine>\S+) (?P<version>\S+), from (?P<wheel>\S+\.whl), sha256 (?P<sha>[0-9a-f]{64}), ")


@dataclass(frozen=True)
class Release:
    """One fixture: the release, the flags its parser registers and the facts read with them."""

    engine: str
    version: str
    flags: frozenset[str]
    facts: tuple[str, ...]


def _read(path: Path) -> Release:
    lines = path.read_text().splitlines()
    head = HEADER.match(lines[0])
    assert head, f"{path.name}: no release header"
    assert path.name == f"{head['engine']}-{head['version']}.txt"
    assert head["wheel"].startswith(f"{head['engine']}-{head['version']}-")
    flags = frozenset(line for line in lines if line and not line.startswith("#"))
    facts = tuple(line[2:] for line in lines[1:] if line.startswith("# "))
    return Release(head["engine"], head["version"], flags, facts)


RELEASES = {(r.engine, r.version): r for r in map(_read, sorted(FLAGS.glob("*.txt")))}


def _versions(engine: str) -> list[str]:
    return [v for e, v in RELEASES if e == engine]


# How the builder starts each engine; what follows is the engine's parser's to read.
ENTRY = {"vllm": ["vllm", "serve"], "sglang": ["python3", "-m", "sglang.launch_server"]}


def engine_args(engine: str, argv: list[str]) -> list[str]:
    """The part of `argv` the engine's parser reads: after its entry point."""
    entry = ENTRY[engine]
    assert argv[: len(entry)] == entry
    return argv[len(entry) :]


def unknown_flags(args: list[str], flags: frozenset[str]) -> list[str]:
    """The flags in `args` (`--a=b` read as `--a`) that are not among `flags`, in order."""
    used = [arg.split("=", 1)[0] for arg in args if arg.startswith("-")]
    return [flag for flag in used if flag not in flags]


def _start(engine: str, *, tp: int = 1, pp: int = 1, nnodes: int = 1, rank: int = 0) -> wire.StartShard:
    profile = wire.EngineProfile(
        name="llama-70b",
        engine=engine,
        tp=tp,
        pp=pp,
        nodes=nnodes,
        model_path="/models/Llama-3.3-70B-Instruct",
        served_model_name="llama-3.3-70b",
        # The profile's own args are the operator's; what is checked here is what the builder adds.
        args=[],
    )
    return wire.StartShard(
        id="c1",
        replica_id="r1",
        shard_id=f"r1-{rank}",
        rank=rank,
        nnodes=nnodes,
        leader_addr="10.0.0.11" if nnodes > 1 else "",
        leader_port=29500 if nnodes > 1 else None,
        http_port=8001,
        gpu_indices=list(range(min(tp * pp, 8))),
        profile=profile,
    )


SHAPES = {
    "one node, tp=1": {},
    "one node, tp=2 pp=2": {"tp": 2, "pp": 2},
    "two nodes tp=16, rank 0": {"tp": 16, "nnodes": 2, "rank": 0},
    "two nodes tp=16, rank 1": {"tp": 16, "nnodes": 2, "rank": 1},
    "two nodes tp=8 pp=2, rank 0": {"tp": 8, "pp": 2, "nnodes": 2, "rank": 0},
    "two nodes tp=8 pp=2, rank 1": {"tp": 8, "pp": 2, "nnodes": 2, "rank": 1},
}

# What a shape needs from a release beyond the basics: without these flags the
# builder must refuse the shape instead of starting an engine that dies on them.
MULTINODE = {
    "vllm": frozenset({"--nnodes", "--node-rank", "--master-addr", "--master-port"}),
    "sglang": frozenset({"--nnodes", "--node-rank", "--dist-init-addr"}),
}
PIPELINE = {"vllm": frozenset({"--pipeline-parallel-size"}), "sglang": frozenset({"--pp-size"})}


def _needs(engine: str, shape: dict) -> frozenset[str]:
    needs = frozenset()
    if shape.get("nnodes", 1) > 1:
        needs |= MULTINODE[engine]
    if shape.get("pp", 1) > 1:
        needs |= PIPELINE[engine]
    return needs


CASES = [
    pytest.param(engine, version, name, id=f"{engine}-{version}-{name}")
    for engine, version in RELEASES
    for name in SHAPES
]


def test_the_fixtures_cover_the_floors_and_a_newer_release():
    # The releases the builder's version gates rest on, the one before each, and one newer.
    assert {"0.11.0", "0.11.1"} < set(_versions("vllm"))
    assert {"0.4.6.post1", "0.4.6.post2"} < set(_versions("sglang"))
    assert len(_versions("vllm")) >= 3
    assert len(_versions("sglang")) >= 3


@pytest.mark.parametrize(("engine", "version", "shape"), CASES)
def test_every_flag_the_agent_emits_is_one_the_release_defines(engine, version, shape):
    release = RELEASES[(engine, version)]
    start = _start(engine, **SHAPES[shape])
    if _needs(engine, SHAPES[shape]) - release.flags:
        with pytest.raises(engines.EngineError, match=re.escape(version)):
            engines.build(start, version=version)
        return
    argv = engines.build(start, version=version).argv
    assert unknown_flags(engine_args(engine, argv), release.flags) == []
    # The shape's own flags are in the argv, not just allowed by the release.
    assert _needs(engine, SHAPES[shape]) <= set(argv)


@pytest.mark.parametrize(
    ("engine", "version", "shape", "absent"),
    [
        ("vllm", "0.11.0", "two nodes tp=16, rank 0", MULTINODE["vllm"]),
        ("vllm", "0.11.0", "two nodes tp=8 pp=2, rank 1", MULTINODE["vllm"]),
        ("sglang", "0.4.6.post1", "one node, tp=2 pp=2", {"--pp-size"}),
        ("sglang", "0.4.6.post1", "two nodes tp=8 pp=2, rank 0", {"--pp-size"}),
    ],
)
def test_the_agent_refuses_what_the_release_lacks(engine, version, shape, absent):
    # The floor is the release's: it has none of these flags, so the engine would die on them.
    assert absent.isdisjoint(RELEASES[(engine, version)].flags)
    with pytest.raises(engines.EngineError, match=re.escape(version)):
        engines.build(_start(engine, **SHAPES[shape]), version=version)


@pytest.mark.parametrize(
    ("engine", "version", "present"),
    [("vllm", "0.11.1", MULTINODE["vllm"] | {"--headless"}), ("sglang", "0.4.6.post2", {"--pp-size"})],
)
def test_the_floor_release_has_the_flags(engine, version, present):
    assert present <= RELEASES[(engine, version)].flags


@pytest.mark.parametrize(
    ("args", "flags", "unknown"),
    [
        # A vLLM worker's args against a release without --headless.
        (
            ["/m", "--host", "0.0.0.0", "--port", "8001", "--nnodes", "2", "--headless"],
            frozenset({"--host", "--port", "--nnodes"}),
            ["--headless"],
        ),
        # `--a=b` is read as `--a`.
        (["--model-path", "/m", "--tp=2"], frozenset({"--model-path", "--tp-size"}), ["--tp"]),
        # A short flag counts too.
        (["/m", "-tp", "2"], frozenset({"--tensor-parallel-size"}), ["-tp"]),
        # A prefix argparse would expand is still not the flag.
        (["--tp", "2"], frozenset({"--tp-size"}), ["--tp"]),
        # Values are not flags.
        (["/m", "--served-model-name", "a-b", "--port", "8001"], frozenset({"--served-model-name", "--port"}), []),
    ],
)
def test_unknown_flags_names_what_the_release_lacks(args, flags, unknown):
    assert unknown_flags(args, flags) == unknown


@pytest.mark.parametrize(("engine", "version"), list(RELEASES))
def test_a_release_missing_an_emitted_flag_fails_the_check(engine, version):
    # The same check as above, against the release with one of the emitted flags taken out.
    args = engine_args(engine, engines.build(_start(engine, tp=2), version=version).argv)
    flags = RELEASES[(engine, version)].flags - {"--served-model-name"}
    assert unknown_flags(args, flags) == ["--served-model-name"]


@pytest.mark.parametrize("version", _versions("sglang"))
def test_sglang_has_no_tp_flag_only_tp_size(version):
    release = RELEASES[("sglang", version)]
    assert "--tp" not in release.flags
    assert "--tp-size" in release.flags
    # `--tp` parses today only because argparse expands a unique prefix.
    assert any(fact.startswith("abbreviations: on") for fact in release.facts)
    assert "--tp-size" in engines.build(_start("sglang", tp=2), version=version).argv


@pytest.mark.parametrize(("engine", "version"), list(RELEASES))
def test_the_entry_point_is_the_releases(engine, version):
    release = RELEASES[(engine, version)]
    assert engines.build(_start(engine), version=version).argv[: len(ENTRY[engine])] == ENTRY[engine]
    if engine == "vllm":
        assert any(fact.startswith("entry: vllm serve ") for fact in release.facts)
        assert {"--served-model-name", "--tensor-parallel-size", "--pipeline-parallel-size"} <= release.flags
    else:
        assert "entry: python3 -m sglang.launch_server (sglang/launch_server.py)" in release.facts
        assert {"--model-path", "--served-model-name", "--enable-metrics"} <= release.flags
