"""The operator API and the agent endpoints, fuzzed from their own OpenAPI document against a running server.

The production web server (scripts/serve.sh) runs against the test database;
schemathesis generates requests from the document (a few per operation, so
the whole run stays well under two minutes) and checks each answer: never a
5xx, and its status, content type, headers and body as the document declares
them. An operation whose declaration is wrong fails here, as a client
generated from the document would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.specs.openapi import checks as openapi_checks

from llmgw import tokens
from placement.models import Deployment, EngineProfile
from tests.factories import make_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_PER_OPERATION = 4
# No 5xx, and every answer as declared. Not "a schema-valid request is accepted": a
# profile id that does not exist, or a name already taken, is valid by the
# document and rightly refused.
CHECKS = [
    checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
]
# The whole run's bound: a server that hangs fails the test instead of the suite.
RUN_DEADLINE_S = 110.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    """scripts/serve.sh on a port the OS chose, against the test database; its base URL."""
    db = connection.settings_dict
    port = _free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        "DEBUG": "0",
        "SECRET_KEY": "llmgw-fuzz-test",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "LLMGW_CACHE_PREFIX": django_settings.CACHES["default"].get("KEY_PREFIX", "llmgw-test"),
        "CELERY_BROKER_URL": "memory://",
        "LLMGW_WEB_SERVER": "granian",
        "WEB_CONCURRENCY": "1",
        "LLMGW_WEB_THREADS": "2",
        "LLMGW_WEB_LOG_LEVEL": "warning",
        "PYTHON": sys.executable,
    }
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh"), f"127.0.0.1:{port}"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                httpx.get(f"{url}/api/v1/nodes/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not answer within 30 s"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_operation_answers_as_documented(server, operator):
    now = timezone.now()
    make_node("node-a", now=now)
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=0)
    _, secret = tokens.create(operator, "fuzz", now=now)
    doc = SchemaGenerator().get_schema(request=None, public=True)
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=server, headers={"Authorization": f"Token {secret}"})
    ends = time.monotonic() + RUN_DEADLINE_S
    failures: dict[str, str] = {}
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        assert time.monotonic() < ends, f"the run took over {RUN_DEADLINE_S} s ({operations} operations)"

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS)

        try:
            check()
        except (Exception, BaseExceptionGroup) as exc:  # collected, so one run lists every operation's failures
            failures[operation.label] = _summary(str(exc))
    assert operations >= 30
    assert failures == {}, "\n".join(f"{op}: {why}" for op, why in sorted(failures.items()))


def _summary(report: str) -> str:
    """A schemathesis report's failed checks and what it received, on one line, and how to reproduce it."""
    keep = [
        line.strip()
        for line in report.splitlines()
        if line.strip().startswith(("- ST", "- ", "Received", "Documented", "Expected", "`", "curl "))
    ]
    return " | ".join(keep)[:1500]
