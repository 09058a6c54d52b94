"""llmgw URL configuration. Each app adds its routes through its own urls module."""

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from inventory import metrics
from llmgw import redoc

urlpatterns = [
    # The cockpit is what a person opening the control plane's address wants.
    path("", RedirectView.as_view(pattern_name="admin:index"), name="home"),
    # Browsers ask for /favicon.ico on any page that names none (Redoc, the API's own pages).
    path("favicon.ico", RedirectView.as_view(url=static("llmgw/favicon.svg"), permanent=True), name="favicon"),
    path("admin/", include("inventory.admin_views")),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", redoc.RedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/redoc/redoc.standalone.js", redoc.bundle_view, name="api-redoc-bundle"),
    path("api/v1/", include("llmgw.api_urls")),
    # django-prometheus' metrics followed by llmgw's (inventory.metrics.export).
    path("metrics", metrics.export, name="metrics"),
]
