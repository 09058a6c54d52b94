from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """The control plane's end of the agent protocol."""

    name = "agents"
    default_auto_field = "django.db.models.BigAutoField"
