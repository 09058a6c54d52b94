"""Redoc's page and bundle: nothing fetched from another host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.staticfiles import finders

from llmgw import redoc

pytestmark = pytest.mark.django_db


def test_the_bundle_is_the_sidecars_without_the_redocly_logo_address(client):
    original = Path(finders.find(redoc.BUNDLE)).read_bytes()
    assert original.count(redoc.REDOCLY_LOGO) == 1  # the sidecar's bundle fetches it today
    resp = client.get("/api/redoc/redoc.standalone.js")
    assert resp.status_code == 200 and resp["Content-Type"] == "text/javascript; charset=utf-8"
    assert resp["Cache-Control"] == "public, max-age=86400"
    assert b"cdn.redoc.ly" not in resp.content
    assert resp.content == original.replace(redoc.REDOCLY_LOGO, b"")
    # Whatever else names another host in it is a link or a schema id, never an image or a script.
    fetched = re.findall(rb"""src:\\s*"(https?://[^"]+)""", resp.content)
    assert fetched == []


def test_the_redoc_page_loads_that_bundle_and_a_local_icon(client, operator):
    client.force_login(operator)
    html = client.get("/api/redoc/").content.decode()
    assert '<script src="/api/redoc/redoc.standalone.js"></script>' in html
    assert '<link rel="icon" type="image/svg+xml" href="/static/llmgw/favicon.svg">' in html


def test_the_bundle_answers_only_get(client):
    assert client.post("/api/redoc/redoc.standalone.js").status_code == 405
