"""The Celery app: the worker runs the reconciler, the liveness sweep and fabric scans."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
