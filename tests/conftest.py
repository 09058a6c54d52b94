"""Shared fixtures: a clean telemetry cache, factories for nodes and users, and a real llama-server."""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.contrib.auth.models import Group
from django.core.cache import cache
from django.test import override_settings

from gateway import figures, notify
from inventory import wakeups
from llmgw import roles
from placement import inflight
from tests.factories import make_node, register_payload  # noqa: F401
from tests.llamacpp import llama_server, llama_server_bin, tiny_model  # noqa: F401

NOW = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.UTC)


@pytest.fixture
def now() -> dt.datetime:
    return NOW


@pytest.fixture(autouse=True)
def _clean_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def viewer(django_user_model):
    """A user in the install's viewer group: may look at everything, change nothing."""
    roles.ensure_roles()  # a transactional test starts from a flushed database
    user = django_user_model.objects.create_user("viewer", password="pw-viewer-1")
    user.groups.add(Group.objects.get(name=roles.VIEWER))
    return user


@pytest.fixture
def operator(django_user_model):
    """A staff user in the install's operator group: may look and act."""
    roles.ensure_roles()
    user = django_user_model.objects.create_user("operator", password="pw-operator-1", is_staff=True)
    user.groups.add(Group.objects.get(name=roles.OPERATOR))
    return user


def closed_port() -> int:
    """A localhost TCP port nothing listens on (bound a moment ago, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_gone(monkeypatch) -> Iterator[str]:
    """Redis unreachable: REDIS_URL and the cache point at a closed port (connections are refused).

    Every module-level Redis client is dropped for the test and restored after it.
    """
    url = f"redis://127.0.0.1:{closed_port()}/0"
    for module in (inflight, notify, figures, wakeups):
        monkeypatch.setattr(module, "_client", None)
    with override_settings(REDIS_URL=url, CACHES={"default": {**settings.CACHES["default"], "LOCATION": url}}):
        yield url
