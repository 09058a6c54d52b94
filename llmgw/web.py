"""The control plane's web server: `granian --interface asgi llmgw.web:app` (scripts/serve.sh).

The WSGI application (llmgw/wsgi.py: Django, with the agents' fast path)
behind the front that reads every body before a thread is given to it
(llmgw/front.py). An agent request without a bearer token is refused there,
from its headers, in the agent endpoints' words (agents/api.py).
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
django.setup()

from agents.api import problem  # noqa: E402  (Django must be set up first)
from agents.protocol import UNAUTHENTICATED  # noqa: E402
from agents.wsgi import AGENT_PREFIX  # noqa: E402
from llmgw.front import make_front  # noqa: E402
from llmgw.wsgi import application  # noqa: E402

app = make_front(
    application,
    bearer_paths=(AGENT_PREFIX,),
    bearer_refusal=(UNAUTHENTICATED.detail, problem(401, UNAUTHENTICATED.detail)["WWW-Authenticate"]),
)
