"""Shared fixtures: a clean telemetry cache and factories for nodes and users."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Group, Permission
from django.core.cache import cache

from tests.factories import make_node, register_payload  # noqa: F401

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
    """A user who may look at everything and change nothing."""
    user = django_user_model.objects.create_user("viewer", password="pw-viewer-1")
    group, _ = Group.objects.get_or_create(name="viewer")
    group.permissions.set(Permission.objects.filter(codename__startswith="view_"))
    user.groups.add(group)
    return user


@pytest.fixture
def operator(django_user_model):
    """A user who may look and act (every permission of llmgw's apps)."""
    user = django_user_model.objects.create_user("operator", password="pw-operator-1", is_staff=True)
    group, _ = Group.objects.get_or_create(name="operator")
    group.permissions.set(Permission.objects.filter(content_type__app_label__in=["inventory", "placement", "agents"]))
    user.groups.add(group)
    return user
