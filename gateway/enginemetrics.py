"""Each engine's own load and cache figures, read from its /metrics under the names its version uses.

The names were read in the engines' sources:
- vLLM serves /metrics by default. Requests: `vllm:num_requests_running`,
  `vllm:num_requests_waiting`. Cache: `vllm:kv_cache_usage_perc` and
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` from
  0.9.2 on (the only names from 0.12); up to 0.9.1 `vllm:gpu_cache_usage_perc`
  and `vllm:gpu_prefix_cache_queries_total` / `..._hits_total`.
- SGLang, with `--enable-metrics`: `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage` (KV-cache use),
  `sglang:cache_hit_rate`.
- llama-server, with `--metrics`: `llamacpp:requests_processing`,
  `llamacpp:requests_deferred`, `llamacpp:prompt_tokens_cached_total` over
  `llamacpp:prompt_tokens_total`; no KV-cache usage.
- echo (the test engine) uses vLLM's current names.
An unknown version reads the newest names and falls back to the older ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    """Where each figure lives in an engine's /metrics; several names are tried in order.

    `hits` and `queries` are pairs, index by index: a ratio is only taken within one family,
    since a scrape can hold the new queries counter beside only the deprecated hits one.
    """

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    hit_rate: tuple[str, ...] = ()
    hits: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of an engine: requests running and waiting, KV-cache use, prefix-cache hit ratio."""

    running: float
    waiting: float
    # 0 to 1; None when the engine does not say.
    kv_usage: float | None = None
    # Since the engine started (counters), or the engine's own gauge; None when it does not say.
    hit_ratio: float | None = None

    @property
    def load(self) -> float:
        """Requests on the engine, running or queued."""
        return self.running + self.waiting


VLLM_NEW = Names(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
)
VLLM_OLD = Names(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:gpu_cache_usage_perc",),
    hits=("vllm:gpu_prefix_cache_hits_total",),
    queries=("vllm:gpu_prefix_cache_queries_total",),
)
SGLANG = Names(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    hit_rate=("sglang:cache_hit_rate",),
)
LLAMACPP = Names(
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    hits=("llamacpp:prompt_tokens_cached_total",),
    queries=("llamacpp:prompt_tokens_total",),
)
# The first vLLM that emits the new cache names.
VLLM_NEW_NAMES = (0, 9, 2)


# A build from a checkout without tags calls itself 0.1.devN (setuptools-scm's fallback):
# its age is unknown, not older than 0.9.2.
_UNTAGGED = re.compile(r"0\.1\.dev\d+")


def _version(v: str) -> tuple[int, ...] | None:
    if _UNTAGGED.match(v.strip()):
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", v.strip())
    if not m:
        return None
    return tuple(int(x or 0) for x in m.groups())


def names_for(engine: str, version: str) -> Names:
    """The names an engine at a version serves its figures under."""
    if engine == "vllm":
        parsed = _version(version)
        if parsed is not None and parsed < VLLM_NEW_NAMES:
            return VLLM_OLD
        return VLLM_NEW
    if engine == "sglang":
        return SGLANG
    if engine == "llamacpp":
        return LLAMACPP
    return VLLM_NEW


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")


def samples(text: str) -> dict[str, list[float]]:
    """Each metric name's values, one per label set (an engine with several ranks or models)."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if value != value:  # NaN: nothing measured yet
            continue
        out.setdefault(m.group(1), []).append(value)
    return out


def _first(values: dict[str, list[float]], names: tuple[str, ...], *, mean: bool = False) -> float | None:
    """The first of `names` present: counts summed over label sets, fractions (`mean`) averaged."""
    for n in names:
        if n in values:
            total = sum(values[n])
            return total / len(values[n]) if mean else total
    return None


def hit_ratio(values: dict[str, list[float]], names: Names) -> float | None:
    """The prefix-cache hit ratio: the engine's own gauge, else hits over queries of one family."""
    ratio = _first(values, names.hit_rate, mean=True)
    if ratio is not None:
        return ratio
    for hits, queries in zip(names.hits, names.queries, strict=True):
        if hits in values and queries in values:
            asked = sum(values[queries])
            return sum(values[hits]) / asked if asked else None
    return None


def parse(text: str, names: Names) -> EngineLoad | None:
    """The figures in an engine's /metrics text; None when it has none of the request gauges."""
    values = samples(text)
    running, waiting = _first(values, names.running), _first(values, names.waiting)
    if running is None and waiting is None:
        return None
    ratio = hit_ratio(values, names)
    return EngineLoad(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_usage=_first(values, names.kv_usage, mean=True),
        hit_ratio=ratio,
    )
