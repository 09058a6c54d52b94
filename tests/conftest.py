"""Shared fixtures: a clean telemetry cache, factories for nodes and users, and a real llama-server."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Group
from django.core.cache import cache

from llmgw import roles
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
