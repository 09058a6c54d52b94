from django.apps import AppConfig


class PlacementConfig(AppConfig):
    """Profiles, deployments, replicas, shards, facility policy, the planner and the reconciler."""

    name = "placement"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Answer the inventory's hooks, add placement's doctor checks and metric families to its registries,
        register the reconcile task with Celery (queueing a pass finds it by name in every process), and have
        holds and power budgets mark the change feed on every save and delete, and have each worker process
        build its placement index as it starts (placement/kept.py)."""
        from inventory import doctor, hooks
        from inventory import metrics as inventory_metrics
        from placement import doctor_checks, kept, metrics, tasks, workloads  # noqa: F401

        hooks.register_workloads(workloads.WORKLOADS)
        inventory_metrics.register(metrics.SOURCE)
        doctor.register(doctor_checks.check_replicas_pending, load=doctor_checks.load_pending_replicas)
        kept.connect_signals()
        kept.connect_worker_warmup()
