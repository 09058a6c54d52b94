"""manage.py gateway_key: create prints the secret once, list shows no secret, rotate and revoke recorded."""

from __future__ import annotations

import datetime as dt
import getpass
import io

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from gateway import keys
from gateway.models import ApiKey, KeyEvent

pytestmark = pytest.mark.django_db


def run(*args: str) -> tuple[str, str]:
    """The command's stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    call_command("gateway_key", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice")


def test_create_prints_only_the_secret_and_records_the_login(alice):
    out, err = run(
        "create",
        "--name",
        "ci",
        "--owner",
        "alice",
        "--models",
        "b, a",
        "--rpm",
        "60",
        "--tpm",
        "1000",
        "--tokens-per-day",
        "5000",
        "--tokens-per-month",
        "90000",
        "--expires",
        "30d",
    )
    secret = out.strip()
    assert out == secret + "\n" and secret.startswith("llmgw-sk-")
    key = ApiKey.objects.get()
    assert key.key_hash == keys.hash_secret(secret)
    assert (key.name, key.owner, key.allowed_models) == ("ci", alice, ["a", "b"])
    assert (key.rpm_limit, key.tpm_limit, key.tokens_per_day, key.tokens_per_month) == (60, 1000, 5000, 90000)
    assert abs(key.expires_at - (timezone.now() + dt.timedelta(days=30))) < dt.timedelta(minutes=1)
    assert secret not in err and key.prefix in err
    ev = KeyEvent.objects.get()
    assert (ev.kind, ev.actor, ev.actor_name) == ("created", None, f"manage.py gateway_key ({getpass.getuser()})")


def test_create_with_an_actor_and_an_iso_expiry(alice, operator):
    run("create", "--name", "ci", "--owner", "alice", "--expires", "2099-01-02T03:04:05", "--actor", "operator")
    key = ApiKey.objects.get()
    assert key.expires_at == dt.datetime(2099, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert (key.created_by, KeyEvent.objects.get().actor_name) == (operator, "operator")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--owner", "nobody"], "--owner: Object with username=nobody does not exist."),
        (["--rpm", "-1"], "--rpm: Ensure this value is greater than or equal to 0."),
        (["--tpm", "many"], "--tpm: A valid integer is required."),
        (
            ["--tokens-per-day", "10", "--tokens-per-month", "5"],
            "--tokens-per-day: 10 is more than tokens_per_month (5)",
        ),
        (["--expires", "2000-01-01"], "--expires: must be in the future"),
        (["--expires", "soon"], "--expires: 'soon' is neither Nd (days from now) nor an ISO 8601 date-time"),
        (["--actor", "ghost"], "--actor: no user named 'ghost'"),
        (["--models", "demo," + "m" * 129], "--models: item 2: Ensure this field has no more than 128 characters."),
    ],
)
def test_bad_input_names_the_option(alice, args, message):
    base = {"--name": "ci", "--owner": "alice"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    with pytest.raises(CommandError) as e:
        run("create", *[x for kv in base.items() for x in kv])
    assert str(e.value).startswith(message)
    assert not ApiKey.objects.exists() and not KeyEvent.objects.exists()


def test_list_is_a_table_without_secrets(alice, now):
    k1, s1 = keys.create_key(name="ci", owner=alice, now=now, allowed_models=["demo"], rpm_limit=5, tokens_per_day=9)
    k2, s2 = keys.create_key(name="old", owner=alice, now=now)
    keys.revoke(k2.id, now=now)
    out, _ = run("list")
    lines = out.splitlines()
    assert lines[0].split() == [
        "id",
        "name",
        "prefix",
        "owner",
        "models",
        "rpm",
        "tpm",
        "tokens/day",
        "tokens/month",
        "expires",
        "revoked",
    ]
    assert [line.split() for line in lines[1:]] == [
        [str(k1.id), "ci", k1.prefix, "alice", "demo", "5", "-", "9", "-", "-", "-"]
    ]
    everything, _ = run("list", "--all")
    assert [line.split()[1] for line in everything.splitlines()[1:]] == ["ci", "old"]
    assert s1 not in everything and s2 not in everything


def test_rotate_by_id_or_prefix_and_revoke(alice, operator, now):
    key, old = keys.create_key(name="ci", owner=alice, now=now)
    out, err = run("rotate", str(key.id), "--actor", "operator")
    new = out.strip()
    key.refresh_from_db()
    assert new != old and key.key_hash == keys.hash_secret(new)
    assert new not in err
    out, _ = run("rotate", key.prefix)
    key.refresh_from_db()
    assert key.key_hash == keys.hash_secret(out.strip())
    run("revoke", str(key.id))
    key.refresh_from_db()
    assert key.revoked_at is not None
    with pytest.raises(CommandError, match=r"^key: 'ci' \(\d+\) is already revoked$"):
        run("revoke", str(key.id))
    with pytest.raises(CommandError, match=r"^key: the key 'ci' is revoked; create a new key instead$"):
        run("rotate", str(key.id))
    with pytest.raises(CommandError, match=r"^key: no key has the id or prefix 'llmgw-sk-nope'$"):
        run("revoke", "llmgw-sk-nope")
    login = f"manage.py gateway_key ({getpass.getuser()})"
    assert list(KeyEvent.objects.filter(key=key).values_list("kind", "actor_name")) == [
        ("revoked", login),
        ("rotated", login),
        ("rotated", "operator"),
        ("created", "system"),
    ]
