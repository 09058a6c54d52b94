from django.apps import AppConfig

from gateway import notify


class GatewayConfig(AppConfig):
    """The OpenAI-compatible front door: API keys, usage, and the data plane's routing table."""

    name = "gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Tell the data planes when replicas change state (placement sends the signal on commit)."""
        notify.connect()
