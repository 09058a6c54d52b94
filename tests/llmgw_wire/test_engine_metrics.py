"""Engine figures read from each engine's /metrics under its version's names, combined by its formulas."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_sim import echo
from llmgw_wire.engines import metric_names as names_for
from llmgw_wire.engines.metrics import LLAMACPP, SGLANG, VLLM_NEW, VLLM_OLD, EngineLoad, hit_ratio, parse, samples

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def _values(text: str) -> dict[str, list[float]]:
    return {name: [v for _, v in series] for name, series in samples(text).items()}


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
        ("vllm", "0.8", VLLM_OLD),
        # A source build without tags (seen reported as "vLLM 0.1.dev20051+g487ecf187"): age unknown.
        ("vllm", "0.1.dev20051+g487ecf187", VLLM_NEW),
        ("sglang", "0.5.2", SGLANG),
        ("llamacpp", "b6500", LLAMACPP),
        ("llama-server", "0.6.0-dev", LLAMACPP),
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


def test_llamacpp_hit_ratio_counts_cached_tokens_among_all_prompt_tokens():
    # prompt_tokens_total counts the tokens llama-server processed, the cached ones excluded:
    # 51 cached beside 88 processed is 51 / 139, where cached / processed read 0.58 (and could pass 1).
    text = "llamacpp:prompt_tokens_total 88\nllamacpp:prompt_tokens_cached_total 51\nllamacpp:requests_processing 1\n"
    assert parse(text, LLAMACPP) == EngineLoad(1.0, 0.0, None, 51 / 139)
    text = "llamacpp:prompt_tokens_total 10\nllamacpp:prompt_tokens_cached_total 40\nllamacpp:requests_deferred 2\n"
    assert parse(text, LLAMACPP).hit_ratio == 0.8


def test_sglang_counts_each_pipeline_stage_once_and_adds_data_parallel_groups():
    # With pp 2 each stage's scheduler reports the same requests under its pp_rank: 3 running, not 6.
    text = (
        'sglang:num_running_reqs{model_name="m",pp_rank="0",tp_rank="0"} 3\n'
        'sglang:num_running_reqs{model_name="m",pp_rank="1",tp_rank="0"} 3\n'
        'sglang:num_queue_reqs{model_name="m",pp_rank="0",tp_rank="0"} 2\n'
        'sglang:num_queue_reqs{model_name="m",pp_rank="1",tp_rank="0"} 2\n'
    )
    assert parse(text, names_for("sglang", "0.5.2")) == EngineLoad(3.0, 2.0, None, None)
    # Two data-parallel groups hold different requests: they add up.
    text = (
        'sglang:num_running_reqs{dp_rank="0",pp_rank="0"} 2\nsglang:num_running_reqs{dp_rank="0",pp_rank="1"} 2\n'
        'sglang:num_running_reqs{dp_rank="1",pp_rank="0"} 4\nsglang:num_running_reqs{dp_rank="1",pp_rank="1"} 4\n'
    )
    assert parse(text, SGLANG).running == 6.0


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


# Recordings: /metrics text real engines printed, pasted in public threads (see fixtures/engines/SOURCES.md).


def test_recorded_vllm_v1_with_the_old_names():
    text = _read("vllm-0.8-production-stack-318.txt")
    # Idle engine; the queries family is announced (HELP, TYPE) with no sample after it in the paste.
    assert parse(text, names_for("vllm", "0.8")) == EngineLoad(0.0, 0.0, 0.0, None)
    # An unknown version reads the new names first and falls back to the old KV gauge.
    assert parse(text, names_for("vllm", "")) == EngineLoad(0.0, 0.0, 0.0, None)


def test_recorded_vllm_0_10_serves_old_and_new_cache_names_and_created_gauges():
    text = _read("vllm-0.10.0-production-stack-617.txt")
    values = _values(text)
    assert values["vllm:kv_cache_usage_perc"] == [9.75010481363281e-06]
    assert values["vllm:prefix_cache_queries_total"] == [32.0]
    assert values["vllm:gpu_prefix_cache_hits_total"] == [0.0]
    # prometheus_client's `_created` timestamps are families of their own, never counts.
    assert values["vllm:gpu_prefix_cache_queries_created"] == [1.7537953269352946e09]
    assert "vllm:gpu_prefix_cache_queries_total" not in values
    # The paste holds the new queries counter but only the deprecated hits counter: no ratio
    # is made across the two families (it read 0/32 = 0.0 before).
    assert hit_ratio(samples(text), names_for("vllm", "0.10.0")) is None
    # The request gauges fall outside the pasted excerpt.
    assert parse(text, names_for("vllm", "0.10.0")) is None


def test_hit_ratio_takes_the_first_family_with_both_counters():
    values = {"vllm:gpu_prefix_cache_hits_total": [((), 5.0)], "vllm:gpu_prefix_cache_queries_total": [((), 20.0)]}
    assert hit_ratio(values, VLLM_NEW) == 0.25
    values["vllm:prefix_cache_hits_total"] = [((), 3.0)]
    values["vllm:prefix_cache_queries_total"] = [((), 4.0)]
    assert hit_ratio(values, VLLM_NEW) == 0.75
    zero = {"vllm:prefix_cache_hits_total": [((), 0.0)], "vllm:prefix_cache_queries_total": [((), 0.0)]}
    assert hit_ratio(zero, VLLM_NEW) is None


def test_recorded_sglang():
    text = _read("sglang-main-2025-03-sglang-pr4444.txt")
    # num_queue_reqs and cache_hit_rate fall outside the pasted excerpt.
    assert parse(text, names_for("sglang", "")) == EngineLoad(0.0, 0.0, 0.0, None)


def test_recorded_llamacpp_with_escaped_comment_lines():
    text = _read("llamacpp-master-2025-01-llama.cpp-pr11512.txt")
    # The paste escapes `#` as `\#`; those lines are not samples and must not be read as any.
    assert _values(text) == {"llamacpp:requests_processing": [0.0], "llamacpp:requests_deferred": [0.0]}
    assert parse(text, names_for("llamacpp", "")) == EngineLoad(0.0, 0.0, None, None)


def test_recorded_llamacpp_11434_under_load():
    # A real scrape (SOURCES.md): two requests generating, 165 prompt tokens taken from the cache
    # beside 194 processed: the hit ratio is 165 / 359, where cached / processed read 0.85.
    text = _read("llamacpp-11434-metrics.txt")
    assert parse(text, names_for("llamacpp", "0.6.0-dev")) == EngineLoad(2.0, 0.0, None, 165 / (165 + 194))
