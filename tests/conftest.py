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

# The slowest modules, with the seconds all their tests took in a full `pytest -n 4` run on two busy
# cores (docs/tests.md). Under `pytest -n` they run first: a long test handed out last keeps the whole
# run waiting on the one worker that drew it, while first it overlaps the many short ones.
SLOWEST_MODULES = {
    "tests/test_faults.py": 710,
    "tests/test_packaging.py": 605,
    "tests/test_newcomer.py": 417,
    "tests/browser/test_cockpit.py": 221,
    "tests/gateway/test_dataplane.py": 207,
    "tests/test_makefile.py": 182,
    "tests/inventory/test_liveness.py": 149,
    "tests/agents/test_property.py": 102,
    "tests/gateway/test_openai_sdk.py": 91,
    "tests/test_docs_runnable.py": 86,
    "tests/agents/test_wakeup_e2e.py": 85,
    "tests/placement/test_e2e.py": 85,
    "tests/gateway/test_redis_outage.py": 81,
    "tests/inventory/test_fleet_silence.py": 81,
    "tests/llmgw_sim/test_fleet.py": 79,
    "tests/test_process_deaths.py": 76,
    "tests/gateway/test_budgets.py": 75,
    "tests/llmgw/test_connection_pool.py": 69,
    "tests/test_prometheus.py": 68,
    "tests/test_control_plane_restart.py": 62,
    "tests/gateway/test_autoscale_e2e.py": 58,
    "tests/test_api_fuzz.py": 46,
    "tests/gateway/test_drain.py": 42,
}


def pytest_collection_modifyitems(config, items):
    """Under `pytest -n`, the slowest modules first, then the other tests marked slow, then the rest.

    Only in xdist's workers (each sorts its collection the same way, and the
    scheduler hands tests out in that order): one process runs in file order.
    """
    if not hasattr(config, "workerinput"):
        return

    def key(item) -> tuple[int, bool]:
        seconds = SLOWEST_MODULES.get(item.nodeid.split("::", 1)[0], 0)
        return -seconds, item.get_closest_marker("slow") is None

    items.sort(key=key)  # stable: in file order within each rank


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
