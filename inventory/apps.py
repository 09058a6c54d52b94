from django.apps import AppConfig


class InventoryConfig(AppConfig):
    """Nodes, GPUs, fabrics, NVLink domains, allocations and telemetry."""

    name = "inventory"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # /metrics (django-prometheus) serves the default registry; llmgw's
        # collector joins it once per process.
        from inventory import metrics

        metrics.register()
