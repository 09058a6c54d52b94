"""Operator API tokens from the command line (llmgw/tokens.py, manage.py api_token)."""

from __future__ import annotations

import io

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token

pytestmark = pytest.mark.django_db


def api_token(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("api_token", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_prints_only_the_token_and_it_authenticates(client, operator):
    out, err = api_token("create", "--user", "operator", "--name", "ci")
    secret = out.strip()
    assert out == secret + "\n"
    assert Token.objects.get(user=operator).key == secret
    assert "'ci'" in err
    assert client.get("/api/v1/nodes/").status_code in (401, 403)
    resp = client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=f"Token {secret}")
    assert resp.status_code == 200
    entry = LogEntry.objects.get(object_id=str(operator.pk))
    assert (entry.user_id, entry.change_message) == (operator.pk, "API token 'ci' created (manage.py api_token)")
    assert secret not in entry.object_repr + entry.change_message


def test_unknown_user_is_named_and_nothing_is_written(operator):
    with pytest.raises(CommandError, match="user: no user 'nobody'"):
        api_token("create", "--user", "nobody", "--name", "ci")
    assert Token.objects.count() == 0
    assert LogEntry.objects.count() == 0


def test_a_second_token_for_the_same_user_is_refused(operator):
    first, _ = api_token("create", "--user", "operator", "--name", "ci")
    with pytest.raises(CommandError, match="already has an API token"):
        api_token("create", "--user", "operator", "--name", "grafana")
    assert list(Token.objects.values_list("key", flat=True)) == [first.strip()]


def test_a_blank_name_is_refused(operator):
    with pytest.raises(CommandError, match=r"^name: "):
        api_token("create", "--user", "operator", "--name", "  ")
    assert Token.objects.count() == 0


def test_an_inactive_user_gets_no_token(operator):
    operator.is_active = False
    operator.save()
    with pytest.raises(CommandError, match="'operator' is inactive"):
        api_token("create", "--user", "operator", "--name", "ci")


def test_name_and_user_are_required():
    with pytest.raises(CommandError, match="--user"):
        api_token("create", "--name", "ci")
