"""manage.py gateway_demo: an echo deployment and an API key for it, and the curl line that uses them."""

from __future__ import annotations

import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from gateway import keys
from placement import audit, deployments
from placement.models import Deployment, EngineProfile


class Command(BaseCommand):
    help = (
        "Create (once) an echo deployment served as MODEL and a new API key for it; "
        "print a curl line through the gateway."
    )

    def add_arguments(self, parser):
        parser.add_argument("--model", default="demo")
        parser.add_argument("--replicas", type=int, default=2)
        parser.add_argument("--gateway", default="http://" + os.environ.get("LLMGW_GATEWAY_LISTEN", "127.0.0.1:8080"))

    def handle(self, *args, model: str, replicas: int, gateway: str, **kw):
        now = timezone.now()
        user, _ = get_user_model().objects.get_or_create(username="demo", defaults={"is_active": True})
        profile = EngineProfile.objects.filter(name=f"echo-{model}").first()
        if profile is None:
            profile = EngineProfile(name=f"echo-{model}", engine="echo", gpus_per_node=1, served_model_name=model)
            audit.save(profile, now=now, actor=None)
        if not Deployment.objects.filter(served_model=model).exists():
            with transaction.atomic():
                dep = Deployment.objects.create(name=model, served_model=model, profile=profile, replicas=replicas)
                deployments.record(dep, "created", f"created by gateway_demo: {replicas} replicas", now=now)
            self.stdout.write(f"deployment {model!r}: {replicas} echo replicas")
        key, secret = keys.create_key(name=f"demo-{now:%Y%m%d-%H%M%S}", owner=user, now=now, allowed_models=[model])
        self.stdout.write(f"API key {key.prefix}... for {model!r}; once its replicas are ready:")
        self.stdout.write(
            f"curl -s {gateway}/v1/chat/completions -H 'Authorization: Bearer {secret}' "
            f"-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "hello through the gateway"}}]}}\''
        )
