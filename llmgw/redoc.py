"""Redoc from drf-spectacular-sidecar's bundle, less the one request it makes to another host.

The sidecar ships Redoc's bundle so the page loads nothing from a CDN, but
the bundle itself shows a "by Redocly" logo fetched from cdn.redoc.ly in its
sidebar: an air-gapped cluster's browser waits on it and logs the failure.
No drf-spectacular or Redoc setting hides it, so the bundle is served here
with that address emptied: the image then fails without a request (an empty
src is never fetched) and Redoc drops it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from django.contrib.staticfiles import finders
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET
from drf_spectacular.views import SpectacularRedocView

BUNDLE = "drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js"
REDOCLY_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
# The bundle does not change while the process runs: a browser may keep it a day.
MAX_AGE_S = 86400


@functools.cache
def bundle() -> bytes:
    """The sidecar's Redoc bundle with the Redocly logo's address emptied."""
    found = finders.find(BUNDLE)
    if not found:
        raise ImproperlyConfigured(f"{BUNDLE} not found: is drf_spectacular_sidecar installed?")
    return Path(found).read_bytes().replace(REDOCLY_LOGO, b"")


@require_GET
def bundle_view(request: HttpRequest) -> HttpResponse:
    """Serve the bundle (public, as the sidecar's own static files are)."""
    resp = HttpResponse(bundle(), content_type="text/javascript; charset=utf-8")
    resp["Cache-Control"] = f"public, max-age={MAX_AGE_S}"
    return resp


class RedocView(SpectacularRedocView):
    """drf-spectacular's Redoc page, loading the bundle above."""

    @staticmethod
    def _redoc_standalone() -> str:
        return reverse("api-redoc-bundle")
