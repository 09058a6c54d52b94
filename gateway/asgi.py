"""The gateway's data plane as an ASGI application: `granian --interface asgi gateway.asgi:app`."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
django.setup()

from agents.wakeup import with_agent_wakeup  # noqa: E402
from gateway.dataplane.app import make_app  # noqa: E402  (Django must be set up first)

# The agents' long-poll (GET /api/v1/agent/wait) is served by this ASGI process too (agents/wakeup.py).
app = with_agent_wakeup(make_app())
