"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import include, path
from rest_framework.routers import DefaultRouter

router = DefaultRouter()

urlpatterns: list = [
    path("agent/", include("agents.urls")),
    *router.urls,
]
