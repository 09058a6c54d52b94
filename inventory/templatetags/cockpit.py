"""Template filters of the cockpit pages: link rates and ages as a person reads them."""

from __future__ import annotations

import datetime as dt

from django import template
from django.utils import timezone

from inventory import node_view

register = template.Library()


@register.filter
def bps(value: float | None) -> str:
    """Bits per second, e.g. "42.0 Gb/s"."""
    return node_view.rate(float(value or 0))


@register.filter
def ago(value: dt.datetime | None) -> str:
    """How long ago, e.g. "5m"."""
    return node_view.age(value, timezone.now())


@register.filter
def seconds(value: float | None) -> str:
    """A duration in seconds as an age, e.g. "10m"."""
    if value is None:
        return "never"
    now = timezone.now()
    return node_view.age(now - dt.timedelta(seconds=float(value)), now)
