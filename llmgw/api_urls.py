"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import include, path, re_path
from rest_framework.routers import DefaultRouter

from gateway import api as gateway_api
from inventory.api import DoctorView, GPUViewSet, NodeViewSet, NVLinkView
from placement import api as placement_api
from placement import prometheus_sd

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GPUViewSet, basename="gpu")
router.register("profiles", placement_api.ProfileViewSet, basename="profile")
router.register("deployments", placement_api.DeploymentViewSet, basename="deployment")
router.register("replicas", placement_api.ReplicaViewSet, basename="replica")
router.register("shards", placement_api.ShardViewSet, basename="shard")
router.register("placement-events", placement_api.EventViewSet, basename="placement-event")
router.register("holds", placement_api.HoldViewSet, basename="hold")
router.register("power-budgets", placement_api.PowerBudgetViewSet, basename="power-budget")
router.register("gateway/keys", gateway_api.KeyViewSet, basename="gateway-key")

urlpatterns: list = [
    path("agent/", include("agents.urls")),
    # With a trailing slash as every other endpoint. Without one it answers too, as it
    # always has (a POST cannot be redirected), and stays out of the API document.
    path("placement/dry-run/", placement_api.DryRunView.as_view(), name="placement-dry-run"),
    path("placement/dry-run", placement_api.DryRunView.as_view(schema=None)),
    path("gateway/usage/", gateway_api.UsageView.as_view(), name="gateway-usage"),
    *router.urls,
    re_path(r"^nvlink/?$", NVLinkView.as_view(), name="nvlink"),
    re_path(r"^doctor/?$", DoctorView.as_view(), name="doctor"),
    # Prometheus' http_sd_config: every agent's and ready engine's metrics endpoint.
    path("prometheus/targets", prometheus_sd.targets_view, name="prometheus-targets"),
]
