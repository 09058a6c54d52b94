"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import path
from rest_framework.routers import DefaultRouter

router = DefaultRouter()

urlpatterns: list = [*router.urls]
_ = path
