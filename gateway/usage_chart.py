"""A key's tokens per day as a bar chart's geometry, for an inline SVG the server renders (no script, no CDN)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    """One day's bar: its day and tokens, and where it is drawn (SVG user units, y downward)."""

    day: dt.date
    tokens: int
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Chart:
    """The bars, the tallest day's tokens (the scale), and the drawing's size."""

    bars: tuple[Bar, ...]
    peak: int
    width: int
    height: int
    total: int


def daily_chart(days: list[tuple[dt.date, int]], *, width: int = 600, height: int = 120, gap: float = 2.0) -> Chart:
    """Bars for `days` (oldest first), scaled so the busiest day fills the height; a day without use has none."""
    peak = max((t for _, t in days), default=0)
    slot = width / max(1, len(days))
    bars = tuple(
        Bar(
            day=day,
            tokens=tokens,
            x=round(i * slot + gap / 2, 2),
            y=round(height - (tokens / peak * height if peak else 0), 2),
            width=round(max(1.0, slot - gap), 2),
            height=round(tokens / peak * height if peak else 0, 2),
        )
        for i, (day, tokens) in enumerate(days)
    )
    return Chart(bars=bars, peak=peak, width=width, height=height, total=sum(t for _, t in days))
