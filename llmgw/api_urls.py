"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import include, path, re_path
from rest_framework.routers import DefaultRouter

from inventory.api import GPUViewSet, NodeViewSet, NVLinkView
from inventory.doctor_api import DoctorView

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GPUViewSet, basename="gpu")

urlpatterns: list = [
    path("agent/", include("agents.urls")),
    *router.urls,
    re_path(r"^nvlink/?$", NVLinkView.as_view(), name="nvlink"),
    re_path(r"^doctor/?$", DoctorView.as_view(), name="doctor"),
]
