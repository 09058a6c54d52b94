"""Operator API tokens: hashed at rest, named, expiring; created and revoked by command and in the admin."""

from __future__ import annotations

import datetime as dt
import importlib
import io

import pytest
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.messages import get_messages
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from knox.crypto import hash_token
from rest_framework.test import APIClient

from llmgw import tokens
from llmgw.models import OperatorToken

pytestmark = pytest.mark.django_db


def api_token(*args: str) -> str:
    out = io.StringIO()
    call_command("api_token", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def get_nodes(secret: str):
    return APIClient().get("/api/v1/nodes/", HTTP_AUTHORIZATION=f"Token {secret}")


def test_create_prints_only_the_token_and_stores_only_its_digest(operator):
    out = api_token("create", "--user", "operator", "--name", "ci")
    secret = out.strip()
    assert out == secret + "\n" and secret.startswith("llmgw-op-") and len(secret) > 60
    row = OperatorToken.objects.get()
    assert (row.user, row.name, row.digest) == (operator, "ci", hash_token(secret))
    with connection.cursor() as cur:
        cur.execute(f"SELECT * FROM {OperatorToken._meta.db_table}")
        stored = cur.fetchall()
    assert secret not in repr(stored)
    assert get_nodes(secret).status_code == 200


def test_tokens_expire(operator):
    row, secret = tokens.create(operator, "laptop", now=timezone.now() - dt.timedelta(days=3), days=2)
    assert row.expiry < timezone.now()
    assert get_nodes(secret).status_code == 401
    # Knox forgets an expired token when it is presented.
    assert not OperatorToken.objects.exists()


def test_default_lifetime_is_the_configured_ttl(operator, now):
    row, _ = tokens.create(operator, "ci", now=now)
    assert row.expiry == now + dt.timedelta(days=90)


def test_revoke_by_name(operator):
    secret = api_token("create", "--user", "operator", "--name", "ci").strip()
    other = api_token("create", "--user", "operator", "--name", "laptop").strip()
    api_token("revoke", "--user", "operator", "--name", "ci")
    assert get_nodes(secret).status_code == 401
    assert get_nodes(other).status_code == 200
    with pytest.raises(CommandError, match="--name: operator has no token named 'ci'"):
        api_token("revoke", "--user", "operator", "--name", "ci")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--user", "nobody", "--name", "x"], "--user: no user named 'nobody'"),
        (["--user", "operator", "--name", " "], "a token needs a name of 1 to 128 characters"),
        (["--user", "operator", "--name", "x", "--days", "0"], "a token lives 1 to 3650 days"),
    ],
)
def test_create_refusals_name_what_is_wrong(operator, args, message):
    with pytest.raises(CommandError, match=message):
        api_token("create", *args)
    assert not OperatorToken.objects.exists()


def test_a_name_is_unique_per_user(operator):
    api_token("create", "--user", "operator", "--name", "ci")
    with pytest.raises(CommandError, match="operator already has a token named 'ci': revoke it first"):
        api_token("create", "--user", "operator", "--name", "ci")
    assert OperatorToken.objects.count() == 1


def test_a_viewer_token_reads_but_does_not_write(viewer):
    _, secret = tokens.create(viewer, "dash", now=timezone.now())
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    assert c.get("/api/v1/profiles/").status_code == 200
    assert c.post("/api/v1/profiles/", {"name": "p", "engine": "echo"}, format="json").status_code == 403


def test_admin_creates_a_token_shown_once_and_revokes_it(client, admin_user, operator):
    client.force_login(admin_user)
    resp = client.post(
        "/admin/llmgw/operatortoken/add/", {"user": operator.pk, "name": "grafana", "days": 7}, follow=True
    )
    assert resp.status_code == 200
    [text] = [str(m) for m in get_messages(resp.wsgi_request) if "copy it now" in str(m)]
    secret = text.split(": ")[1].split(" ")[0]
    row = OperatorToken.objects.get()
    assert (row.user, row.name, row.digest) == (operator, "grafana", hash_token(secret))
    assert dt.timedelta(days=6, hours=23) < row.expiry - timezone.now() <= dt.timedelta(days=7)
    assert get_nodes(secret).status_code == 200
    page = client.get(f"/admin/llmgw/operatortoken/{row.pk}/change/")
    assert secret.encode() not in page.content
    client.post(f"/admin/llmgw/operatortoken/{row.pk}/delete/", {"post": "yes"})
    assert get_nodes(secret).status_code == 401


@pytest.mark.parametrize("token", ["llmgw-op-\xff\xfe", "llmgw-op-abc\x00def0123456789abcdef", "short", "x" * 300])
def test_a_malformed_token_is_401(operator, token):
    # WSGI hands headers over as latin-1 text: \xff is not UTF-8 once knox encodes it back.
    resp = Client().get("/api/v1/nodes/", HTTP_AUTHORIZATION="Token " + token)
    assert resp.status_code == 401
    assert resp.json() == {"detail": "Invalid token."}


def test_the_plaintext_token_table_of_the_old_scheme_is_dropped():
    migration = importlib.import_module("llmgw.migrations.0002_drop_plaintext_api_tokens")
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY)")
        cur.execute("INSERT INTO authtoken_token VALUES ('0123456789abcdef0123456789abcdef01234567')")
        cur.execute(migration.DROP)
    assert "authtoken_token" not in connection.introspection.table_names()


def test_the_command_line_leaves_who_and_when_in_the_admin_history(operator):
    api_token("create", "--user", operator.username, "--name", "ci")
    api_token("revoke", "--user", operator.username, "--name", "ci")
    rows = list(LogEntry.objects.order_by("id").values_list("user_id", "action_flag", "change_message"))
    assert rows == [
        (operator.id, ADDITION, "API token 'ci' created (manage.py api_token)"),
        (operator.id, DELETION, "API token 'ci' revoked (manage.py api_token)"),
    ]
