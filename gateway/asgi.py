"""The gateway's data plane as an ASGI application: `granian --interface asgi gateway.asgi:app`."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
django.setup()

from agents.lease_asgi import with_agent_lease  # noqa: E402
from agents.wakeup import with_agent_wakeup  # noqa: E402
from gateway.dataplane.app import make_app  # noqa: E402  (Django must be set up first)

# The agents' long-poll (GET /api/v1/agent/wait, agents/wakeup.py) and their batched lease
# renewals (POST /api/v1/agent/lease, agents/lease_asgi.py) are served by this ASGI process too.
app = with_agent_lease(with_agent_wakeup(make_app()))
