"""Engine figures read from each engine's /metrics under its version's names."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.node import echo
from gateway.enginemetrics import LLAMACPP, SGLANG, VLLM_NEW, VLLM_OLD, EngineLoad, names_for, parse

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("engine", "version", "names"),
    [
        ("vllm", "0.12.0", VLLM_NEW),
        ("vllm", "0.10.1.1", VLLM_NEW),
        ("vllm", "0.9.2", VLLM_NEW),
        ("vllm", "0.9.1", VLLM_OLD),
        ("vllm", "v0.8.5.post1", VLLM_OLD),
        ("vllm", "", VLLM_NEW),
        ("sglang", "0.5.2", SGLANG),
        ("llamacpp", "b6500", LLAMACPP),
        ("echo", "", VLLM_NEW),
    ],
)
def test_names_follow_engine_and_version(engine, version, names):
    assert names_for(engine, version) is names


def test_vllm_current():
    assert parse(_read("vllm-0.12.0.txt"), names_for("vllm", "0.12.0")) == EngineLoad(7.0, 2.0, 0.4375, 0.75)


def test_vllm_old_names():
    assert parse(_read("vllm-0.9.1.txt"), names_for("vllm", "0.9.1")) == EngineLoad(3.0, 0.0, 0.125, 0.25)
    # Read with the new names it has no cache figures, but the request gauges are the same.
    assert parse(_read("vllm-0.9.1.txt"), VLLM_OLD).load == 3.0


def test_vllm_unknown_version_falls_back_to_old_names():
    assert parse(_read("vllm-0.9.1.txt"), names_for("vllm", "")) == EngineLoad(3.0, 0.0, 0.125, 0.25)


def test_sglang():
    assert parse(_read("sglang-0.5.2.txt"), names_for("sglang", "0.5.2")) == EngineLoad(12.0, 5.0, 0.62, 0.81)


def test_llamacpp_has_no_kv_usage():
    assert parse(_read("llamacpp-b6500.txt"), names_for("llamacpp", "b6500")) == EngineLoad(2.0, 1.0, None, 0.25)


def test_no_figures_and_label_sets():
    assert parse("# nothing here\nprocess_cpu_seconds_total 3\n", VLLM_NEW) is None
    text = (
        'sglang:num_running_reqs{tp_rank="0",dp_rank="0"} 2\nsglang:num_running_reqs{tp_rank="0",dp_rank="1"} 3\n'
        'sglang:token_usage{dp_rank="0"} 0.2\nsglang:token_usage{dp_rank="1"} 0.4\nsglang:cache_hit_rate NaN\n'
    )
    got = parse(text, SGLANG)
    assert (got.running, got.waiting, got.hit_ratio) == (5.0, 0.0, None)
    assert got.kv_usage == pytest.approx(0.3)


def test_the_echo_engine_speaks_vllm():
    srv = echo.EchoServer(("127.0.0.1", 0), model="demo", load_seconds=0)
    try:
        srv.cache.admit(["a"] * 32)
        srv.cache.admit(["a"] * 32)
        assert parse(srv.metrics(), names_for("echo", "")) == EngineLoad(0.0, 0.0, 2 / 2048, 0.5)
    finally:
        srv.server_close()
