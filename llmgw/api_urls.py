"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import include, path, re_path
from rest_framework.routers import DefaultRouter

from inventory.api import DoctorView, GPUViewSet, NodeViewSet, NVLinkView
from placement import prometheus_sd
from placement import views as placement_views

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GPUViewSet, basename="gpu")
router.register("profiles", placement_views.ProfileViewSet, basename="profile")
router.register("deployments", placement_views.DeploymentViewSet, basename="deployment")
router.register("replicas", placement_views.ReplicaViewSet, basename="replica")
router.register("shards", placement_views.ShardViewSet, basename="shard")
router.register("placement-events", placement_views.EventViewSet, basename="placement-event")
router.register("holds", placement_views.HoldViewSet, basename="hold")
router.register("power-budgets", placement_views.PowerBudgetViewSet, basename="power-budget")

urlpatterns: list = [
    path("agent/", include("agents.urls")),
    # With a trailing slash as every other endpoint. Without one it answers too, as it
    # always has (a POST cannot be redirected), and stays out of the API document.
    path("placement/dry-run/", placement_views.DryRunView.as_view(), name="placement-dry-run"),
    path("placement/dry-run", placement_views.DryRunView.as_view(schema=None)),
    *router.urls,
    re_path(r"^nvlink/?$", NVLinkView.as_view(), name="nvlink"),
    re_path(r"^doctor/?$", DoctorView.as_view(), name="doctor"),
    # Prometheus' http_sd_config: every agent's and ready engine's metrics endpoint.
    path("prometheus/targets", prometheus_sd.targets_view, name="prometheus-targets"),
]
