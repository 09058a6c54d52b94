"""WSGI entry point (gunicorn llmgw.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

application = get_wsgi_application()

# Imported after setup: the agent endpoints skip the middleware stack (agents/wsgi.py).
from django.conf import settings  # noqa: E402

from agents.wsgi import with_agent_fast_path  # noqa: E402
from llmgw.deadline import with_body_deadline  # noqa: E402
from llmgw.health import with_health  # noqa: E402

# /healthz and /readyz are answered first, outside Django's handling (llmgw/health.py). Under
# gunicorn every body is read within LLMGW_BODY_TIMEOUT (llmgw/deadline.py); under granian the
# front has read it already (llmgw/front.py).
application = with_health(with_body_deadline(with_agent_fast_path(application), timeout_s=settings.LLMGW_BODY_TIMEOUT))
