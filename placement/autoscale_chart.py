"""A deployment's replicas and autoscaling signal over time as two lines' geometry, for an inline SVG.

The server renders it (no script, no CDN), as the key page's usage chart.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One series: its SVG polyline points, its highest value (the scale) and its last value."""

    points: str
    peak: float
    last: float | None


@dataclass(frozen=True)
class Chart:
    """The replicas (a step line) and the signal over [start, end], and the drawing's size."""

    start: dt.datetime
    end: dt.datetime
    width: int
    height: int
    replicas: Line
    signal: Line
    samples: int


def _x(at: dt.datetime, start: dt.datetime, span: float, width: int) -> float:
    return round((at - start).total_seconds() / span * width, 2)


def _y(v: float, peak: float, height: int) -> float:
    return round(height - (v / peak * height if peak else 0.0), 2)


def chart(
    samples: Sequence[tuple[dt.datetime, int, float | None]],
    *,
    start: dt.datetime,
    end: dt.datetime,
    width: int = 600,
    height: int = 120,
) -> Chart:
    """Lines for `samples` ((time, replicas set, signal), oldest first), each scaled to its own peak.

    The replicas line steps (a count holds until the next sample); the signal
    line leaves out the samples where nothing was measured.
    """
    span = max(1.0, (end - start).total_seconds())
    peak_r = float(max((r for _, r, _ in samples), default=0))
    points: list[str] = []
    for i, (at, r, _) in enumerate(samples):
        x = _x(at, start, span, width)
        if i:
            points.append(f"{x},{_y(samples[i - 1][1], peak_r, height)}")
        points.append(f"{x},{_y(r, peak_r, height)}")
    if samples:
        points.append(f"{width},{_y(samples[-1][1], peak_r, height)}")
    measured = [(at, s) for at, _, s in samples if s is not None]
    peak_s = max((s for _, s in measured), default=0.0)
    signal = " ".join(f"{_x(at, start, span, width)},{_y(s, peak_s, height)}" for at, s in measured)
    return Chart(
        start=start,
        end=end,
        width=width,
        height=height,
        replicas=Line(" ".join(points), peak_r, float(samples[-1][1]) if samples else None),
        signal=Line(signal, peak_s, measured[-1][1] if measured else None),
        samples=len(samples),
    )
