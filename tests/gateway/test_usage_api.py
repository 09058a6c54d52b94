"""The usage report (/api/v1/gateway/usage/): by key, model and bucket, JSON and CSV, exact figures."""

from __future__ import annotations

import csv
import datetime as dt
import io

import pytest
from rest_framework.test import APIClient

from gateway import keys, usage
from tests.test_api_document import _check, doc  # noqa: F401  (the document, as /api/schema/ serves it)

pytestmark = pytest.mark.django_db

USAGE = "/api/v1/gateway/usage/"
# 2026-11-30 12:00 UTC (the suite's `now`).
T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def client(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


@pytest.fixture
def workload(operator):
    """Two keys, two models, over two hours and two days, with known sums."""
    a, _ = keys.create_key(name="a", owner=operator, now=T0 - dt.timedelta(days=2))
    b, _ = keys.create_key(name="b", owner=operator, now=T0 - dt.timedelta(days=2))
    acc = usage.Accumulator()
    t = T0.timestamp()
    acc.add(a.id, "demo", t, prompt_tokens=10, completion_tokens=5)  # 12:00
    acc.add(a.id, "demo", t + 30, prompt_tokens=1, completion_tokens=1, error=True)  # 12:00
    acc.add(a.id, "demo", t + 60, prompt_tokens=2, completion_tokens=3)  # 12:01
    acc.add(a.id, "big", t + 3600, prompt_tokens=100, completion_tokens=50)  # 13:00
    acc.add(b.id, "demo", t + 120, prompt_tokens=7, completion_tokens=0)  # 12:02
    acc.add(b.id, "demo", t - 86400, prompt_tokens=1000, completion_tokens=1000)  # the day before
    usage.write_batch(acc.take())
    return a, b


def test_anonymous_refused_and_viewer_reads(viewer):
    assert client().get(USAGE).status_code == 401
    assert client(viewer).get(USAGE).status_code == 200


def test_by_key_and_model_over_a_range(viewer, workload, doc):  # noqa: F811
    a, b = workload
    r = client(viewer).get(USAGE, {"start": "2026-11-30T00:00:00Z", "end": "2026-12-01T00:00:00Z"})
    assert r.status_code == 200
    _check(doc, "get", USAGE, r)
    body = r.json()
    assert (body["start"], body["end"], body["group_by"], body["bucket"]) == (
        "2026-11-30T00:00:00Z",
        "2026-12-01T00:00:00Z",
        ["key", "model"],
        None,
    )
    assert body["rows"] == [
        {
            "bucket": None,
            "key_id": a.id,
            "key_name": "a",
            "model": "big",
            "requests": 1,
            "prompt_tokens": 100,
            "completion_tokens": 50,
            "total_tokens": 150,
            "errors": 0,
        },
        {
            "bucket": None,
            "key_id": a.id,
            "key_name": "a",
            "model": "demo",
            "requests": 3,
            "prompt_tokens": 13,
            "completion_tokens": 9,
            "total_tokens": 22,
            "errors": 1,
        },
        {
            "bucket": None,
            "key_id": b.id,
            "key_name": "b",
            "model": "demo",
            "requests": 1,
            "prompt_tokens": 7,
            "completion_tokens": 0,
            "total_tokens": 7,
            "errors": 0,
        },
    ]


def _figures(rows: list[dict], *names: str) -> list[tuple]:
    return [tuple(r[n] for n in names) for r in rows]


def test_buckets_and_groupings(viewer, workload):
    a, _ = workload
    c = client(viewer)
    day = {"start": "2026-11-29T00:00:00Z", "end": "2026-12-01T00:00:00Z"}
    rows = c.get(USAGE, {**day, "group_by": "model", "bucket": "day"}).json()["rows"]
    assert _figures(rows, "bucket", "model", "requests", "total_tokens") == [
        ("2026-11-29T00:00:00Z", "demo", 1, 2000),
        ("2026-11-30T00:00:00Z", "big", 1, 150),
        ("2026-11-30T00:00:00Z", "demo", 4, 29),
    ]
    assert all("key_id" not in r for r in rows)
    rows = c.get(
        USAGE, {"start": "2026-11-30T12:00:00Z", "end": "2026-11-30T14:00:00Z", "group_by": "key", "bucket": "hour"}
    ).json()["rows"]
    assert _figures(rows, "bucket", "key_name", "requests", "prompt_tokens", "completion_tokens") == [
        ("2026-11-30T12:00:00Z", "a", 3, 13, 9),
        ("2026-11-30T12:00:00Z", "b", 1, 7, 0),
        ("2026-11-30T13:00:00Z", "a", 1, 100, 50),
    ]
    assert all("model" not in r for r in rows)
    rows = c.get(
        USAGE,
        {
            "start": "2026-11-30T12:00:00Z",
            "end": "2026-11-30T12:02:00Z",
            "bucket": "minute",
            "key": a.id,
            "model": "demo",
        },
    ).json()["rows"]
    assert _figures(rows, "bucket", "key_name", "model", "requests", "total_tokens", "errors") == [
        ("2026-11-30T12:00:00Z", "a", "demo", 2, 17, 1),
        ("2026-11-30T12:01:00Z", "a", "demo", 1, 5, 0),
    ]


def test_csv_by_format_and_by_accept(viewer, workload):
    a, b = workload
    c = client(viewer)
    q = {"start": "2026-11-30T12:00:00Z", "end": "2026-11-30T14:00:00Z", "bucket": "hour"}
    r = c.get(USAGE, {**q, "format": "csv"})
    assert r.status_code == 200
    assert r["Content-Type"] == "text/csv; charset=utf-8"
    assert list(csv.reader(io.StringIO(r.content.decode()))) == [
        [
            "bucket",
            "key_id",
            "key_name",
            "model",
            "requests",
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "errors",
        ],
        ["2026-11-30T12:00:00Z", str(a.id), "a", "demo", "3", "13", "9", "22", "1"],
        ["2026-11-30T12:00:00Z", str(b.id), "b", "demo", "1", "7", "0", "7", "0"],
        ["2026-11-30T13:00:00Z", str(a.id), "a", "big", "1", "100", "50", "150", "0"],
    ]
    by_accept = c.get(USAGE, {**q, "group_by": "model"}, HTTP_ACCEPT="text/csv")
    assert by_accept["Content-Type"].startswith("text/csv")
    assert by_accept.content.decode().splitlines()[1:] == [
        "2026-11-30T12:00:00Z,,,demo,4,20,9,29,1",
        "2026-11-30T13:00:00Z,,,big,1,100,50,150,0",
    ]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"bucket": "week"}, "bucket"),
        ({"group_by": "key,replica"}, "group_by"),
        ({"group_by": ","}, "group_by"),
        ({"start": "yesterday"}, "start"),
        ({"end": "2026-13-01"}, "end"),
        ({"start": "2026-11-30T12:00:00Z", "end": "2026-11-30T11:00:00Z"}, "start"),
        ({"start": "2026-11-01T00:00:00Z", "end": "2026-11-30T00:00:00Z", "bucket": "minute"}, "start"),
        ({"key": "one"}, "key"),
        ({"key": "0"}, "key"),
    ],
)
def test_bad_parameters_are_a_400_naming_them(viewer, params, field, doc):  # noqa: F811
    r = client(viewer).get(USAGE, params)
    assert r.status_code == 400
    assert list(r.json()) == [field]
    _check(doc, "get", USAGE, r)
    # Asked for CSV, a refusal still comes as JSON.
    r = client(viewer).get(USAGE, {**params, "format": "csv"})
    assert (r.status_code, r["Content-Type"], list(r.json())) == (400, "application/json", [field])


def test_query_count(viewer, workload, django_assert_num_queries):
    c = client(viewer)
    c.get(USAGE)  # the user's permissions, read once and cached
    with django_assert_num_queries(1):
        assert c.get(USAGE, {"start": "2026-11-29T00:00:00Z", "end": "2026-12-01T00:00:00Z"}).status_code == 200
