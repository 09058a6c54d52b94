from django.apps import AppConfig


class PlacementConfig(AppConfig):
    """Profiles, deployments, replicas, shards, facility policy, the planner and the reconciler."""

    name = "placement"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the reconcile task with Celery, so that queueing a pass finds it by name in every process."""
        from placement import tasks  # noqa: F401
