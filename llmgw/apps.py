from django.apps import AppConfig
from django.db.models.signals import post_migrate


class LlmgwConfig(AppConfig):
    """The project itself, as an app: its management commands, and the roles kept after migrate."""

    name = "llmgw"
    verbose_name = "llmgw"

    def ready(self) -> None:
        from llmgw import roles

        # All senders: each app's post_migrate comes after auth created its permissions.
        post_migrate.connect(roles.on_post_migrate, dispatch_uid="llmgw.roles")
