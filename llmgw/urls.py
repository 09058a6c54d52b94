"""llmgw URL configuration. Each app adds its routes through its own urls module."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from inventory import metrics

urlpatterns = [
    path("admin/", include("inventory.admin_views")),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/v1/", include("llmgw.api_urls")),
    # django-prometheus' metrics followed by llmgw's (inventory.metrics.export).
    path("metrics", metrics.export, name="metrics"),
]
