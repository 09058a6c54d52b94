from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """The control plane's end of the agent protocol."""

    name = "agents"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Tell inventory's node page where a node's credential comes from."""
        from agents import credentials
        from inventory import node_view

        node_view.register_credential_source(credentials.credential_box)
