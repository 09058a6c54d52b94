"""The project's own routes: the front page and the icon."""

from __future__ import annotations

import pytest


def test_the_front_page_is_the_cockpit(client):
    resp = client.get("/")
    assert resp.status_code == 302 and resp["Location"] == "/admin/"


def test_favicon_ico_points_at_the_icon_which_is_served(client):
    resp = client.get("/favicon.ico")
    assert resp.status_code == 301 and resp["Location"] == "/static/llmgw/favicon.svg"
    icon = client.get("/static/llmgw/favicon.svg")
    assert icon.status_code == 200
    assert b"".join(icon.streaming_content).startswith(b'<svg xmlns="http://www.w3.org/2000/svg"')


@pytest.mark.django_db
@pytest.mark.parametrize(
    "page", ["/admin/login/", "/admin/", "/admin/inventory/node/", "/admin/gateway/routedreplica/"]
)
def test_every_admin_page_names_the_icon(client, operator, page):
    if page != "/admin/login/":  # the login page sends a signed-in user on
        client.force_login(operator)
    resp = client.get(page)
    assert resp.status_code == 200
    assert '<link rel="icon" type="image/svg+xml" href="/static/llmgw/favicon.svg">' in resp.content.decode()
