"""Keys' per-minute limits as OpenAI's headers say them: the windows and the durations."""

from __future__ import annotations

import datetime as dt

import pytest
from asgiref.sync import async_to_sync

from gateway.dataplane.limits import Limiter, Shared, Window, duration
from gateway.table import KeyEntry


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.02, "20ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"), (17.284, "17.284s"), (59.9, "59.9s"), (360, "6m0s")],
)
def test_durations_in_openais_form(seconds, text):
    assert duration(seconds) == text


def test_headers_name_only_the_limits_a_key_has():
    both = Window(rpm_limit=10, requests=3, tpm_limit=1000, tokens=1200, reset=6.5, retry_after=None)
    assert both.headers() == [
        (b"x-ratelimit-limit-requests", b"10"),
        (b"x-ratelimit-remaining-requests", b"7"),
        (b"x-ratelimit-reset-requests", b"6.5s"),
        (b"x-ratelimit-limit-tokens", b"1000"),
        (b"x-ratelimit-remaining-tokens", b"0"),
        (b"x-ratelimit-reset-tokens", b"6.5s"),
    ]
    rpm = Window(rpm_limit=2, requests=3, tpm_limit=0, tokens=0, reset=0.25, retry_after=0.25)
    assert rpm.headers() == [
        (b"x-ratelimit-limit-requests", b"2"),
        (b"x-ratelimit-remaining-requests", b"0"),
        (b"x-ratelimit-reset-requests", b"250ms"),
    ]


def _key(rpm: int, tpm: int) -> KeyEntry:
    return KeyEntry(id=7, name="k", expires_at=None, allowed_models=None, rpm_limit=rpm, tpm_limit=tpm)


def test_admission_counts_the_minute_in_this_processes_memory():
    limiter = Limiter(Shared(None), "t")
    now = dt.datetime(2026, 1, 1, 12, 0, 15, tzinfo=dt.UTC).timestamp()
    assert async_to_sync(limiter.admit)(_key(0, 0), now) is None
    key = _key(2, 10)
    first = async_to_sync(limiter.admit)(key, now)
    assert first == Window(2, 1, 10, 0, 45.0, None)
    async_to_sync(limiter.spend)(key, 4, now)
    assert async_to_sync(limiter.admit)(key, now + 1) == Window(2, 2, 10, 4, 44.0, None)
    assert async_to_sync(limiter.admit)(key, now + 2) == Window(2, 3, 10, 4, 43.0, 43.0)
    # The next minute starts afresh.
    assert async_to_sync(limiter.admit)(key, now + 45) == Window(2, 1, 10, 0, 60.0, None)
