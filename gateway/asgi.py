"""The gateway's data plane as an ASGI application: `granian --interface asgi gateway.asgi:app`."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
django.setup()

from gateway.dataplane.app import make_app  # noqa: E402  (Django must be set up first)

app = make_app()
