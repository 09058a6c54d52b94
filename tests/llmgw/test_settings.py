"""Settings come from the environment; a bad value is refused with its variable's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_READ = (
    "import json; from django.conf import settings as s; "
    "print(json.dumps([s.CELERY_BROKER_URL, s.CELERY_BROKER_TRANSPORT_OPTIONS, "
    "s.DATABASES['default']['ENGINE'], str(s.DATABASES['default']['NAME'])]))"
)


def load_settings(tmp_path, code: str = _READ, **env: str) -> subprocess.CompletedProcess:
    """Run `code` against llmgw.settings in a fresh interpreter: the embedded default, `env` on top."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "SECRET_KEY", "DEBUG"}
    }
    base.update({"DJANGO_SETTINGS_MODULE": "llmgw.settings", "DEBUG": "1", "LLMGW_VAR_DIR": str(tmp_path)})
    base.update(env)
    return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True)


def test_the_embedded_default_keeps_its_files_under_var(tmp_path):
    # kombu's filesystem transport writes its exchange table to ./control
    # unless told otherwise: a laptop's `make run` must not litter the tree.
    done = load_settings(tmp_path)
    assert done.returncode == 0, done.stderr
    broker, options, engine, name = json.loads(done.stdout)
    assert broker == "filesystem://localhost/"
    assert {k: v for k, v in options.items() if k.endswith("_folder") or k.startswith("data_folder")} == {
        "data_folder_in": str(tmp_path / "celery" / "broker"),
        "data_folder_out": str(tmp_path / "celery" / "broker"),
        "processed_folder": str(tmp_path / "celery" / "processed"),
        "control_folder": str(tmp_path / "celery" / "control"),
    }
    assert (engine, name) == ("django.db.backends.sqlite3", str(tmp_path / "llmgw.sqlite3"))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a boolean (use 1/0, true/false)"),
        ({"LLMGW_LOST_AFTER": "5m"}, "LLMGW_LOST_AFTER='5m' is not a number of seconds"),
        ({"LLMGW_UNREACHABLE_AFTER": "0"}, "LLMGW_UNREACHABLE_AFTER='0' must be positive"),
        ({"LLMGW_SHARD_PORT_BASE": "eighteen"}, "LLMGW_SHARD_PORT_BASE='eighteen' is not a whole number"),
        ({"LLMGW_SHARD_PORT_BASE": "0"}, "LLMGW_SHARD_PORT_BASE='0' must be at least 1"),
        ({"DATABASE_CONN_MAX_AGE": "1.5"}, "DATABASE_CONN_MAX_AGE='1.5' is not a whole number"),
        ({"DATABASE_POOL_MAX": "four"}, "DATABASE_POOL_MAX='four' is not a whole number"),
        ({"DATABASE_POOL_TIMEOUT": "0"}, "DATABASE_POOL_TIMEOUT='0' must be positive"),
        ({"LLMGW_SHARD_PORTS_UNIQUE": "si"}, "LLMGW_SHARD_PORTS_UNIQUE='si' is not a boolean"),
        ({"LLMGW_METRICS_ALLOW": "10.0.0.0/8,prometheus"}, "LLMGW_METRICS_ALLOW: 'prometheus' is not an address"),
        (
            {"DEBUG": "0", "SECRET_KEY": ""},
            "SECRET_KEY must be set when DEBUG is off (or set DEBUG=1 on a laptop)",
        ),
    ],
)
def test_a_bad_value_names_its_variable(tmp_path, env, message):
    done = load_settings(tmp_path, **env)
    assert done.returncode != 0
    assert f"ImproperlyConfigured: {message}" in done.stderr


def test_postgresql_connections_come_from_a_bounded_pool_unless_turned_off(tmp_path):
    code = (
        "import json; from django.conf import settings as s; d = s.DATABASES['default']; "
        "print(json.dumps([d['CONN_MAX_AGE'], d.get('OPTIONS', {}).get('pool')]))"
    )
    url = "postgres://u@db.example:5432/llmgw"
    done = load_settings(tmp_path, code, DATABASE_URL=url, DATABASE_POOL_MAX="6", DATABASE_POOL_TIMEOUT="5")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, {"min_size": 1, "max_size": 6, "timeout": 5.0, "max_idle": 60.0}]
    # Persistent connections, one per thread, when the pool is turned off.
    done = load_settings(tmp_path, code, DATABASE_URL=url, DATABASE_POOL_MAX="0", DATABASE_CONN_MAX_AGE="600")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [600, None]


def test_numbers_and_flags_are_read(tmp_path):
    code = (
        "from django.conf import settings as s; "
        "print(s.LLMGW_SHARD_PORT_BASE, s.LLMGW_SHARD_PORTS_UNIQUE, s.LLMGW_LOST_AFTER, s.DEBUG)"
    )
    done = load_settings(
        tmp_path,
        code,
        SECRET_KEY="k",
        DEBUG="off",
        LLMGW_SHARD_PORT_BASE="20000",
        LLMGW_SHARD_PORTS_UNIQUE="yes",
        LLMGW_LOST_AFTER="90",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["20000", "True", "90.0", "False"]


def test_metrics_access_is_read(tmp_path):
    code = "from django.conf import settings as s; print(s.LLMGW_METRICS_TOKEN, *s.LLMGW_METRICS_ALLOW)"
    done = load_settings(tmp_path, code, LLMGW_METRICS_TOKEN="t0k", LLMGW_METRICS_ALLOW="10.0.0.7, fd00::/8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["t0k", "10.0.0.7/32", "fd00::/8"]


def test_the_wakeup_url_comes_from_its_variable_or_the_gateways_listen_address():
    import socket

    from llmgw.settings import wakeup_url

    assert wakeup_url("", "") == ""
    assert wakeup_url("", "127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert wakeup_url("https://gw.example/", "127.0.0.1:8080") == "https://gw.example"
    # A wildcard address names no host an agent could dial: this host's name stands in.
    assert wakeup_url("", "0.0.0.0:8080") == f"http://{socket.getfqdn()}:8080"
    assert wakeup_url("", "[::]:8080") == f"http://{socket.getfqdn()}:8080"


def test_the_lease_url_is_the_wakeup_gateways_unless_turned_off():
    from llmgw.settings import lease_url

    gw = "http://gw:8080"
    # On by default: the gateway's that serves the wakeup long-poll, with PostgreSQL.
    assert lease_url("", gw, postgresql=True) == "http://gw:8080/api/v1/agent/lease"
    assert lease_url("on", gw, postgresql=True) == "http://gw:8080/api/v1/agent/lease"
    # SQLite takes one writer at a time, so its agents keep the web's; so do they with no gateway known.
    assert lease_url("", gw, postgresql=False) == ""
    assert lease_url("ON", gw, postgresql=False) == ""
    assert lease_url("", "", postgresql=True) == ""
    assert lease_url("on", "", postgresql=True) == ""
    # "off": the web's own endpoint.
    assert lease_url("off", gw, postgresql=True) == ""
    assert lease_url(" OFF ", gw, postgresql=True) == ""
    assert lease_url("https://lb.example/lease/", gw, postgresql=False) == "https://lb.example/lease"


def test_a_bad_lease_url_is_refused_with_its_variables_name(tmp_path):
    done = load_settings(tmp_path, "import django; django.setup()", LLMGW_LEASE_URL="gw:8080")
    assert done.returncode != 0 and "LLMGW_LEASE_URL='gw:8080': an http(s) URL with a host" in done.stderr


def test_a_bad_wakeup_url_is_refused_with_its_variables_name(tmp_path):
    done = load_settings(tmp_path, "import django; django.setup()", LLMGW_WAKEUP_URL="gw:8080")
    assert done.returncode != 0 and "LLMGW_WAKEUP_URL='gw:8080': an http(s) URL with a host" in done.stderr
    done = load_settings(tmp_path, "import django; django.setup()", LLMGW_GATEWAY_LISTEN="8080")
    assert done.returncode != 0 and "LLMGW_GATEWAY_LISTEN='8080': use host:port" in done.stderr
