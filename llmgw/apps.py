from django.apps import AppConfig


class LlmgwConfig(AppConfig):
    """The project itself, as an app, for its management commands."""

    name = "llmgw"
    verbose_name = "llmgw"
