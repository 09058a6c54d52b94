"""The engine registry: one reading of names and versions for the agent and the control plane."""

from __future__ import annotations

import pytest

from llmgw_wire import engines
from llmgw_wire.engines import Version, llamacpp_build, python_release


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("llamacpp", "llamacpp"),
        ("llama-server", "llamacpp"),
        ("llama.cpp", "llamacpp"),
        ("Llama.CPP ", "llamacpp"),
        ("llama_cpp", "llamacpp"),
        ("vllm", "vllm"),
        ("SGLang", "sglang"),
        ("echo", "echo"),
        ("tgi", ""),
    ],
)
def test_canonical_names(name, canonical):
    assert engines.canonical(name) == canonical


def test_unknown_engine_names_the_known_ones():
    with pytest.raises(engines.UnknownEngine, match=r"unknown engine 'tgi' \(known: vllm, sglang, llamacpp, echo\)"):
        engines.get("tgi")


def test_canonical_versions_keeps_what_it_does_not_know():
    assert engines.canonical_versions({"llama-server": "b4589", "vllm": "0.11.0", "tgi": "3.2"}) == {
        "llamacpp": "b4589",
        "vllm": "0.11.0",
        "tgi": "3.2",
    }


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("0.11.0", (0, 11, 0, 0)),
        ("0.4.6.post2", (0, 4, 6, 2)),
        ("0.6.3.post1+cu124", (0, 6, 3, 1)),
        ("0.11.0rc1", (0, 11, 0, 0)),
        ("v0.8.5.post1", (0, 8, 5, 1)),
        ("0.11", (0, 11, 0, 0)),
        # A build on its way to a release reads as that release.
        ("0.11.1.dev12+g1a2b3c4", (0, 11, 1, 0)),
        # Untagged checkouts (setuptools-scm's fallback) say nothing of their age: unknown.
        ("0.1.dev20051+g487ecf187", None),
        ("0.0.0", None),
        ("", None),
        ("nightly", None),
    ],
)
def test_python_release(text, key):
    assert python_release(text) == Version(text=text, key=key)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("version: 4589 (1a2b3c4d)", Version("b4589", (4589,))),
        ("b6500", Version("b6500", (6500,))),
        ("version: 0.6.0 (build 7012, commit 1a2b3c4)", Version("b7012", (7012,))),
        # A build from a source tarball: no git, build 0, its age unknown.
        ("version: 0.6.0-dev (build 0, commit unknown)", Version("0.6.0-dev", None)),
        ("0.6.0-dev", Version("0.6.0-dev", None)),
        ("version: 0 (unknown)", Version("version: 0 (unknown)", None)),
    ],
)
def test_llamacpp_build(text, version):
    assert llamacpp_build(text) == version


def test_an_unknown_version_passes_every_floor():
    assert Version("0.1.dev1").at_least((99, 0, 0)) is True
    assert python_release("0.11.0").at_least((0, 11, 1)) is False
    assert python_release("0.11.1").at_least((0, 11, 1)) is True
    assert python_release("0.4.6.post1").at_least((0, 4, 6, 2)) is False
    assert python_release("0.4.7").at_least((0, 4, 6, 2)) is True


def test_the_agent_and_the_gateway_read_a_source_build_alike():
    # One reading: the multi-node floor and the metric names agree on an untagged vLLM.
    v = engines.get("vllm").version("0.1.dev20051+g487ecf187")
    assert v.at_least(engines.VLLM_MP_MULTINODE)
    assert engines.metric_names("vllm", "0.1.dev20051+g487ecf187") is engines.metrics.VLLM_NEW
    assert engines.metric_names("vllm", "0.9.1") is engines.metrics.VLLM_OLD


def test_probe_reads_the_stream_the_engine_prints_on():
    llama = engines.get("llamacpp")
    assert llama.probe.stream == "stderr"
    text = "version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0 for Linux x86_64\n"
    assert engines.probe_version(llama, stdout="", stderr=text).text == "0.6.0-dev"
    # The same text on stdout is not where llama-server prints it: no version read.
    assert engines.probe_version(llama, stdout=text, stderr="").text == ""
    vllm = engines.get("vllm")
    assert engines.probe_version(vllm, stdout="INFO 05-01 starting\n0.11.0\n", stderr="").text == "0.11.0"


@pytest.mark.parametrize(
    ("args", "after"),
    [
        ([], 0),
        (["--dp-size", "4"], 0),
        (["--enable-dp-attention", "--dp-size", "4"], 9),
        (["--enable-dp-attention", "--dp=2"], 7),
        (["--enable-dp-attention"], 6),
        (["--enable-dp-attention", "--data-parallel-size", "3"], 8),
        (["--attn-dp-size", "4"], 9),
        (["--attention-data-parallel-size=2"], 7),
        (["--attn-dp-size", "1"], 0),
    ],
)
def test_sglang_ports_after_its_http_port(args, after):
    assert engines.get("sglang").ports_after(args) == after


def test_other_engines_bind_only_their_http_port():
    assert engines.get("vllm").ports_after(["--enable-dp-attention"]) == 0
