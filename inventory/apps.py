from django.apps import AppConfig


class InventoryConfig(AppConfig):
    """Nodes, GPUs, fabrics, NVLink domains, allocations and telemetry."""

    name = "inventory"
    default_auto_field = "django.db.models.BigAutoField"
