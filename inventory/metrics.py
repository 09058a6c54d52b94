"""llmgw's own Prometheus metrics, computed when /metrics is scraped.

Only what the control plane alone knows: node state and heartbeat age, the
cards each node has, holds and has joined to NVLink, the doctor, and the
families other apps register (`register`: placement's replicas).
Each card's sensors and each port's counters are served by the node's own
agent (llmgw_agent.metrics), which Prometheus finds through the service
discovery (placement.prometheus_sd): at ten thousand nodes the control plane
exporting every sensor was 117 MB and seconds a scrape.

Computed at scrape time rather than kept in gauges updated as things happen:
the truth is in the database, shared by many web processes, so each scrape
reads it in a constant number of queries whatever the number of nodes.

Even so a scrape has tens of thousands of samples, and prometheus_client
builds an object per sample and checks every label name as it writes, so
/metrics (`export`) writes django-prometheus' metrics with prometheus_client
and llmgw's families with `render`, which writes the same text (a test
compares the two byte for byte), streamed and gzipped when asked.
`LlmgwCollector` yields the same families for any other registry.
Writing the text was half of a scrape at ten thousand nodes, most of it
escaping each node's name once per family and formatting the same few counts
again and again: `Seen` does each once a scrape.

The doctor's results come from `doctor_refresh.for_scrape`, and a scrape
never runs the checks: within settings.LLMGW_DOCTOR_CACHE seconds of a run
it reuses its checks, later it serves the last results and has the worker
refresh them (llmgw_doctor_age_seconds says how old they are); with none
ever kept it writes no check and an age of -1, and has the worker run them.
"""

from __future__ import annotations

import datetime as dt
import hmac
import ipaddress
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import Count, DateTimeField, F, OuterRef, Subquery, Value
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.middleware.gzip import re_accepts_gzip
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector
from prometheus_client.utils import floatToGoString

from inventory import doctor, doctor_refresh
from inventory import gpus as gpu_rules
from inventory.models import GPU, AllocatedGPU, LivenessClock, Node


@dataclass(slots=True)
class Family:
    """One metric family: its name, type, help and label names, and its samples as (label values, value)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def metric(self) -> Metric:
        """The family as prometheus_client's object (for a registry)."""
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        m = cls(self.name, self.help, labels=list(self.labels))
        for values, value in self.rows:
            m.add_metric(list(values), value)
        return m

    def render(self, out: list[str], seen: Seen | None = None) -> None:
        """Append the family in the text format, as prometheus_client.generate_latest writes it.

        `seen` carries what earlier families of the same scrape escaped and formatted.
        """
        seen = seen or Seen()
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        doc = self.help.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {self.kind}\n")
        # Labels sorted by name, as generate_latest does; one template per family.
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        pairs = ",".join(f'{self.labels[i]}="{{{i}}}"' for i in order)
        template = f"{name}{{{{{pairs}}}}} {{{len(self.labels)}}}\n" if pairs else f"{name} {{0}}\n"
        fmt, escaped, texts = template.format, seen.labels, seen.values
        for values, value in self.rows:
            labels = escaped.get(values)
            if labels is None:
                labels = escaped[values] = tuple(map(_escape, values))
            # -0.0 equals 0.0 as a key but is written "-0.0": a zero is told apart by its sign.
            key = value if value else (value, math.copysign(1.0, value))
            text = texts.get(key)
            if text is None:
                text = texts[key] = floatToGoString(value)
            out.append(fmt(*labels, text))


@dataclass(slots=True)
class Seen:
    """What one scrape has escaped (label values, by their tuple) and formatted (sample values), for its next family.

    A node's name is in six families and most samples are small counts.
    """

    labels: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)
    values: dict[object, str] = field(default_factory=dict)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(frozen=True)
class FamilySource:
    """Metric families another app adds to /metrics (placement's replicas): how to make them, how to fill them.

    `families` makes them empty (describing a collector must not touch the
    database); `fill` appends their samples at scrape time, in a constant
    number of queries like the rest.
    """

    families: Callable[[], list[Family]]
    fill: Callable[[list[Family], dt.datetime], None]


_SOURCES: list[FamilySource] = []


def register(source: FamilySource) -> None:
    """Add a source's families to every scrape, after the inventory's own and before the doctor's (once each)."""
    if source not in _SOURCES:
        _SOURCES.append(source)


def _in_order(own: dict[str, Family], added: list[list[Family]]) -> list[Family]:
    """The inventory's families, then the registered ones in registration order, then the doctor's."""
    last = ("doctor", "doctor_age")
    return [*(f for k, f in own.items() if k not in last), *(f for fs in added for f in fs), *(own[k] for k in last)]


def _families() -> dict[str, Family]:
    return {
        "node_state": Family(
            "llmgw_node_state",
            "gauge",
            "1 for the node's current state (other states are not written).",
            ("node", "state"),
        ),
        "heartbeat_age": Family(
            "llmgw_node_heartbeat_age_seconds", "gauge", "Seconds since the node's last heartbeat.", ("node",)
        ),
        "gpus": Family("llmgw_node_gpus", "gauge", "Cards the node registered.", ("node",)),
        "allocated": Family("llmgw_node_gpus_allocated", "gauge", "Cards a shard holds.", ("node",)),
        "nvlink_joined": Family(
            "llmgw_node_gpus_nvlink_joined",
            "gauge",
            "Cards joined to a multi-node NVLink fabric.",
            ("node",),
        ),
        "imex_up": Family(
            "llmgw_imex_up", "gauge", "1 when nvidia-imex is up (nodes that report IMEX only).", ("node",)
        ),
        "class_gpus": Family("llmgw_gpus", "gauge", "Cards registered, by class (the card's model).", ("class",)),
        "class_allocated": Family(
            "llmgw_gpus_allocated", "gauge", "Cards a shard holds, by class (the card's model).", ("class",)
        ),
        "sweep_age": Family(
            "llmgw_liveness_sweep_age_seconds",
            "gauge",
            "Seconds since the last liveness sweep (not written before the first).",
            (),
        ),
        "mass_silence": Family(
            "llmgw_liveness_mass_silence",
            "gauge",
            "1 while most of the fleet is silent at once: no node is judged meanwhile.",
            (),
        ),
        "doctor": Family(
            "llmgw_doctor_checks",
            "gauge",
            "1 for each doctor check's current result, 0 for the others.",
            ("check", "result"),
        ),
        "doctor_age": Family(
            "llmgw_doctor_age_seconds",
            "gauge",
            "Age of the doctor's results above (refreshed out of band); -1 while none were ever kept.",
            (),
        ),
    }


def collect_families(*, now: dt.datetime | None = None) -> list[Family]:
    """Fill every family from what only the control plane knows; the doctor's results from its cache when recent.

    A card's sensors and a port's counters are the agents' to serve (see
    llmgw_agent.metrics): here each node is a handful of samples, so a scrape
    stays a few MB at ten thousand nodes. No telemetry is read unless the
    doctor's results are stale and its checks must run.
    """
    now = now or timezone.now()
    # The last results at once, a stale or missing one refreshed by the worker (inventory/doctor_refresh.py).
    kept_results = doctor_refresh.for_scrape(now=now)
    # The database subtracts: Django reads a timestamp through a pure-Python loader (a third
    # of a scrape's Python time at 10,000 nodes), an interval in C, to the same microsecond.
    elapsed = Value(now, output_field=DateTimeField()) - F("last_seen")
    nodes = Node.objects.order_by("id").annotate(since=elapsed).values_list("id", "state", "since", "imex_state")
    cards: dict[str, int] = {}
    joined: dict[str, int] = {}
    classes: dict[str, int] = {}
    # Counted by the database per node and fabric report, and the rule asked
    # once per distinct report: a node's cards mostly report the same fabric,
    # and the rule per card was a third of a scrape at 10,000 nodes.
    verdicts: dict[tuple[str, str, str], bool] = {}
    for node_id, *fabric, name, n in (
        GPU.objects.values_list("node_id", "fabric_state", "fabric_status", "cluster_uuid", "name")
        .annotate(n=Count("id"))
        .order_by()
    ):
        key = tuple(fabric)
        classes[name] = classes.get(name, 0) + n
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = gpu_rules.fabric_joined(*key)
        cards[node_id] = cards.get(node_id, 0) + n
        if verdict:
            joined[node_id] = joined.get(node_id, 0) + n
    # Held cards by node and by the class of the card held, in one statement.
    held: dict[str, int] = {}
    held_classes: dict[str, int] = {}
    card_class = GPU.objects.filter(node_id=OuterRef("node_id"), index=OuterRef("gpu_index")).values("name")[:1]
    for node_id, name, n in (
        AllocatedGPU.objects.annotate(card=Subquery(card_class))
        .values_list("node_id", "card")
        .annotate(n=Count("id"))
        .order_by()
    ):
        held[node_id] = held.get(node_id, 0) + n
        held_classes[name or ""] = held_classes.get(name or "", 0) + n
    clock = LivenessClock.objects.filter(id=1).values_list("last_sweep_at", "disruption_since").first()
    f = _families()
    added = [source.families() for source in _SOURCES]
    for source, families in zip(_SOURCES, added, strict=True):
        source.fill(families, now)
    node_state, heartbeat_age, imex_up = f["node_state"].rows, f["heartbeat_age"].rows, f["imex_up"].rows
    gpus, allocated, nvlink_joined = f["gpus"].rows, f["allocated"].rows, f["nvlink_joined"].rows
    for nid, state, since, imex_state in nodes:
        labels = (nid,)
        node_state.append(((nid, state), 1.0))
        if since is not None:
            heartbeat_age.append((labels, max(since.total_seconds(), 0.0)))
        if imex_state:
            imex_up.append((labels, 1.0 if gpu_rules.imex_up(imex_state) else 0.0))
        gpus.append((labels, float(cards.get(nid, 0))))
        allocated.append((labels, float(held.get(nid, 0))))
        nvlink_joined.append((labels, float(joined.get(nid, 0))))
    for name in sorted(classes.keys() | held_classes.keys()):
        f["class_gpus"].rows.append(((name,), float(classes.get(name, 0))))
        f["class_allocated"].rows.append(((name,), float(held_classes.get(name, 0))))
    last_sweep, disruption = clock or (None, None)
    if last_sweep is not None:
        f["sweep_age"].rows.append(((), max((now - last_sweep).total_seconds(), 0.0)))
    f["mass_silence"].rows.append(((), 1.0 if disruption is not None else 0.0))
    if kept_results is None:
        # None kept yet (a fresh install, a flushed cache): no check is written, and the age says why.
        f["doctor_age"].rows.append(((), doctor_refresh.MISSING_AGE))
    else:
        doctor_at, results = kept_results
        for r in results:
            for value in doctor.Result:
                f["doctor"].rows.append(((r.name, str(value)), 1.0 if r.result == value else 0.0))
        f["doctor_age"].rows.append(((), doctor_refresh.age_seconds(doctor_at, now=now)))
    return _in_order(f, added)


def render(families: list[Family]) -> str:
    """The families in Prometheus' text format."""
    out: list[str] = []
    seen = Seen()
    for family in families:
        family.render(out, seen)
    return "".join(out)


class LlmgwCollector(Collector):
    """llmgw's metrics as a prometheus_client collector, for a registry of one's own.

    /metrics does not go through it (see the module docstring); it yields the
    same families.
    """

    def describe(self) -> Iterator[Metric]:
        """The families, without samples: registering must not touch the database."""
        return iter([f.metric() for f in _in_order(_families(), [s.families() for s in _SOURCES])])

    def collect(self) -> Iterator[Metric]:
        """Read the snapshot and yield every family."""
        for family in collect_families():
            yield family.metric()


def may_scrape(*, authorization: str | None, remote_addr: str | None, user: Any = None) -> bool:
    """Whether a /metrics request may read the metrics (settings.LLMGW_METRICS_TOKEN, LLMGW_METRICS_ALLOW).

    The way Prometheus is usually given access: its bearer token (compared in
    constant time), or its address in an allowlist; an operator signed in
    with the view permission on nodes sees what the node API shows them anyway.
    """
    token = settings.LLMGW_METRICS_TOKEN
    if token and authorization:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return True
    if settings.LLMGW_METRICS_ALLOW and remote_addr:
        try:
            addr = ipaddress.ip_address(remote_addr)
        except ValueError:
            addr = None
        if addr is not None and any(addr in net for net in settings.LLMGW_METRICS_ALLOW):
            return True
    return bool(user is not None and user.is_authenticated and user.has_perm("inventory.view_node"))


def refuse_scrape(request: HttpRequest) -> HttpResponse | None:
    """A 401 for a request that may not scrape (see may_scrape), or None when it may.

    /metrics and the Prometheus service discovery share it: both name every node.
    """
    if may_scrape(
        authorization=request.META.get("HTTP_AUTHORIZATION"),
        remote_addr=request.META.get("REMOTE_ADDR"),
        user=getattr(request, "user", None),
    ):
        return None
    resp = HttpResponse("metrics need a bearer token or an allowed address\n", status=401, content_type="text/plain")
    resp["WWW-Authenticate"] = 'Bearer realm="llmgw-metrics"'
    return resp


# zlib's gzip container (a header and a trailer around the deflate stream), and its fastest level.
GZIP_WBITS = 16 + zlib.MAX_WBITS
GZIP_LEVEL = 1


def gzipped(chunks: Iterator[bytes], level: int = GZIP_LEVEL) -> Iterator[bytes]:
    """The chunks as one gzip stream, each compressed as it comes (never the whole body at once)."""
    z = zlib.compressobj(level, zlib.DEFLATED, GZIP_WBITS)
    for chunk in chunks:
        if data := z.compress(chunk):
            yield data
    yield z.flush()


def export(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """/metrics: django-prometheus' metrics, as its own view serves them, then llmgw's.

    Streamed a family at a time, so the serving process never holds the
    whole text; gzipped when the scraper accepts it (Prometheus does), which
    shrinks the repetitive text about eighteenfold. 401 to whoever may not scrape.
    Compressed here rather than by Django's gzip_page, whose level 6 took
    twice as long for 4 % less (and whose random padding against BREACH has
    nothing to guard: the body reflects nothing of the request).
    Accept-Encoding is read as Django reads it.
    """
    if (refused := refuse_scrape(request)) is not None:
        return refused
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    # Read before streaming starts: a database error is a 500, not a truncated body.
    head, families = generate_latest(registry), collect_families()

    def chunks() -> Iterator[bytes]:
        yield head
        seen = Seen()
        for family in families:
            out: list[str] = []
            family.render(out, seen)
            yield "".join(out).encode()

    compress = bool(re_accepts_gzip.search(request.META.get("HTTP_ACCEPT_ENCODING", "")))
    resp = StreamingHttpResponse(gzipped(chunks()) if compress else chunks(), content_type=CONTENT_TYPE_LATEST)
    patch_vary_headers(resp, ("Accept-Encoding",))
    if compress:
        resp["Content-Encoding"] = "gzip"
    return resp
