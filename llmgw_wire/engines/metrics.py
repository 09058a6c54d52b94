"""Each engine's load and cache figures, read from its /metrics under the names its version serves.

The names were read in the engines' sources and checked against recordings
(tests/fixtures/engines/SOURCES.md says which is which):
- vLLM serves /metrics by default. Requests: `vllm:num_requests_running`,
  `vllm:num_requests_waiting`. Cache: `vllm:kv_cache_usage_perc` and
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` from
  0.9.2 on (the only names from 0.12); up to 0.9.1 `vllm:gpu_cache_usage_perc`
  and `vllm:gpu_prefix_cache_queries_total` / `..._hits_total`.
- SGLang, with `--enable-metrics`: `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage` (KV-cache use),
  `sglang:cache_hit_rate`. Every pipeline stage's scheduler reports the same
  requests under its own `pp_rank` (and tensor ranks may too): those are one
  group's requests counted once, while data-parallel groups add up.
- llama-server, with `--metrics`: `llamacpp:requests_processing`,
  `llamacpp:requests_deferred`; `llamacpp:prompt_tokens_total` counts the
  prompt tokens it *processed*, the cached ones excluded, and
  `llamacpp:prompt_tokens_cached_total` (later builds only) the cached ones:
  the hit ratio is cached / (cached + processed). Read as cached / processed,
  as the old code did, the figure could pass 1.
- echo (the test engine) uses vLLM's current names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmgw_wire.engines.versions import Version

# How a pair of counters makes a hit ratio.
HITS_OVER_QUERIES = "hits/queries"
CACHED_OVER_ALL = "cached/(cached+processed)"


@dataclass(frozen=True)
class Names:
    """Where each figure lives in an engine's /metrics; several names are tried in order.

    `hits` and `queries` are pairs, index by index: a ratio is only taken within one family,
    since a scrape can hold the new queries counter beside only the deprecated hits one.
    `once_per` names the labels under which the same requests are reported again
    (SGLang's pipeline and tensor ranks): such series are counted once per group.
    """

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    hit_rate: tuple[str, ...] = ()
    hits: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    ratio: str = HITS_OVER_QUERIES
    once_per: tuple[str, ...] = ()


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
    once_per=("pp_rank", "tp_rank"),
)
LLAMACPP = Names(
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    hits=("llamacpp:prompt_tokens_cached_total",),
    queries=("llamacpp:prompt_tokens_total",),
    ratio=CACHED_OVER_ALL,
)
# The first vLLM that serves the new cache names.
VLLM_NEW_NAMES = (0, 9, 2)


def vllm_names(version: Version) -> Names:
    """vLLM's names at a version; an unknown version reads the new names and falls back to the old."""
    return VLLM_NEW if version.at_least(VLLM_NEW_NAMES) else VLLM_OLD


# One series: its labels and its value.
Series = tuple[tuple[tuple[str, str], ...], float]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def samples(text: str) -> dict[str, list[Series]]:
    """Each metric name's series (labels, value) in Prometheus text; NaN (nothing measured yet) skipped."""
    out: dict[str, list[Series]] = {}
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
        if math.isnan(value):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _counted(series: list[Series], once_per: tuple[str, ...]) -> list[float]:
    """The values that count: series differing only in a `once_per` label are one group, its largest value."""
    if not once_per:
        return [v for _, v in series]
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, v in series:
        key = tuple(kv for kv in labels if kv[0] not in once_per)
        groups[key] = max(groups.get(key, v), v)
    return list(groups.values())


def _first(
    values: dict[str, list[Series]], names: Names, which: tuple[str, ...], *, mean: bool = False
) -> float | None:
    """The first of `which` present: counts summed over groups, fractions (`mean`) averaged."""
    for n in which:
        if n in values:
            counted = _counted(values[n], names.once_per)
            return sum(counted) / len(counted) if mean else sum(counted)
    return None


def hit_ratio(values: dict[str, list[Series]], names: Names) -> float | None:
    """The prefix-cache hit ratio: the engine's own gauge, else its counters by the engine's formula."""
    ratio = _first(values, names, names.hit_rate, mean=True)
    if ratio is not None:
        return ratio
    for hits, queries in zip(names.hits, names.queries, strict=True):
        if hits in values and queries in values:
            hit = sum(_counted(values[hits], names.once_per))
            other = sum(_counted(values[queries], names.once_per))
            asked = hit + other if names.ratio == CACHED_OVER_ALL else other
            return hit / asked if asked else None
    return None


def parse(text: str, names: Names) -> EngineLoad | None:
    """The figures in an engine's /metrics text; None when it has none of the request gauges."""
    values = samples(text)
    running, waiting = _first(values, names, names.running), _first(values, names, names.waiting)
    if running is None and waiting is None:
        return None
    return EngineLoad(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_usage=_first(values, names, names.kv_usage, mean=True),
        hit_ratio=hit_ratio(values, names),
    )
