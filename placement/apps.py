from django.apps import AppConfig


class PlacementConfig(AppConfig):
    """Profiles, deployments, replicas, shards, facility policy, the planner and the reconciler."""

    name = "placement"
    default_auto_field = "django.db.models.BigAutoField"
