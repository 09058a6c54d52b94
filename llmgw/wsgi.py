"""WSGI entry point (gunicorn llmgw.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

application = get_wsgi_application()

# Imported after setup: the agent endpoints skip the middleware stack (agents/wsgi.py).
from agents.wsgi import with_agent_fast_path  # noqa: E402
from llmgw.health import with_health  # noqa: E402

# /healthz and /readyz are answered first, outside Django's handling (llmgw/health.py).
application = with_health(with_agent_fast_path(application))
