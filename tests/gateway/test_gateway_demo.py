"""manage.py gateway_demo: the deployment once, a new key each time, a curl line that carries it."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command

from gateway import keys
from gateway.models import ApiKey
from placement.models import Deployment, PlacementEvent

pytestmark = pytest.mark.django_db


def _run(**kw) -> str:
    out = io.StringIO()
    call_command("gateway_demo", stdout=out, **kw)
    return out.getvalue()


def test_demo_creates_the_deployment_once_and_prints_a_working_key():
    first = _run(gateway="http://127.0.0.1:9999")
    second = _run(gateway="http://127.0.0.1:9999")
    dep = Deployment.objects.get()
    assert (dep.served_model, dep.replicas, dep.profile.engine) == ("demo", 2, "echo")
    assert PlacementEvent.objects.filter(deployment=dep, kind="created").count() == 1
    assert "deployment 'demo'" in first and "deployment 'demo'" not in second
    for text in (first, second):
        secret = re.search(r"Bearer (llmgw-sk-\S+)'", text).group(1)
        key = ApiKey.objects.get(key_hash=keys.hash_secret(secret))
        assert key.allowed_models == ["demo"]
        assert "curl -s http://127.0.0.1:9999/v1/chat/completions" in text
    assert ApiKey.objects.count() == 2
