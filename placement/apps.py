from django.apps import AppConfig


class PlacementConfig(AppConfig):
    """Profiles, deployments, replicas, shards, facility policy, the planner and the reconciler."""

    name = "placement"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Holds and power budgets mark the change feed on every save and delete (placement/kept.py)."""
        from placement import kept

        kept.connect_signals()
