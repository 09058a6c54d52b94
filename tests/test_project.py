"""The project is wired: settings from the environment, admin, API schema, metrics."""

import pytest
from django.conf import settings
from django.core.management import call_command


def test_runs_on_postgresql_and_redis():
    assert settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"
    from django.core.cache.backends.redis import RedisCache
    from django.utils.module_loading import import_string

    # llmgw.cache.RedisCache: Django's, reusing its redis-py client.
    assert issubclass(import_string(settings.CACHES["default"]["BACKEND"]), RedisCache)


@pytest.mark.django_db
def test_admin_login_page(client):
    resp = client.get("/admin/login/")
    assert resp.status_code == 200
    assert b"llmgw" in resp.content or b"Django administration" in resp.content


@pytest.mark.django_db
def test_openapi_schema_and_docs(client, operator):
    client.force_login(operator)
    resp = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert resp.status_code == 200
    assert resp.json()["info"]["title"] == "llmgw API"
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.django_db
def test_metrics_endpoint(client):
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert b"django_http_requests_before_middlewares_total" in b"".join(resp.streaming_content)


def test_celery_app_is_configured():
    from llmgw.celery import app

    assert app.main == "llmgw"
    assert app.conf.broker_url == "memory://"


@pytest.mark.django_db
def test_ensure_admin_creates_once(tmp_path, settings, capsys, django_user_model):
    settings.VAR_DIR = tmp_path
    call_command("ensure_admin")
    out = capsys.readouterr().out
    assert "admin login created: user 'admin'" in out
    assert (tmp_path / "admin-password").stat().st_mode & 0o777 == 0o600
    call_command("ensure_admin")
    assert "admin login exists" in capsys.readouterr().out
    assert django_user_model.objects.filter(is_superuser=True).count() == 1


@pytest.mark.django_db
def test_ensure_admin_show_later_leaves_the_password_for_run_all(tmp_path, settings, capsys):
    # make run's way: the password is printed by scripts/run-all.sh once it is up, not among the migrations.
    settings.VAR_DIR = tmp_path
    call_command("ensure_admin", "--show-later")
    out = capsys.readouterr().out
    username, password = (tmp_path / "admin-password").read_text().splitlines()
    assert username == "admin"
    assert password not in out
    assert "admin login created: user 'admin'; its password is printed once the servers answer" in out
    assert (tmp_path / "admin-password.show").stat().st_mode & 0o777 == 0o600


@pytest.mark.django_db
@pytest.mark.parametrize("page", ["/api/docs/", "/api/redoc/"])
def test_api_docs_come_from_our_own_static_files(client, operator, page):
    """Swagger UI and Redoc load from drf-spectacular-sidecar's files, never a CDN (air-gapped clusters)."""
    import re

    client.force_login(operator)
    resp = client.get(page)
    assert resp.status_code == 200
    html = resp.content.decode()
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert assets, html
    assert [a for a in assets if "//" in a] == [], "a page asset comes from another host"
    scripts = [a for a in assets if a.endswith(".js")]
    # Redoc's bundle is the sidecar's, served by llmgw.redoc less its Redocly logo address.
    ours = ("/static/drf_spectacular_sidecar/", "/api/redoc/redoc.standalone.js")
    assert scripts and all(a.startswith(ours) for a in scripts), scripts
    for asset in assets:
        if asset.startswith(("/static/", "/api/")):
            served = client.get(asset)
            assert served.status_code == 200, asset
            assert b"".join(served.streaming_content if served.streaming else [served.content])
