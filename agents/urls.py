"""The agent endpoints, under /api/v1/agent/."""

from django.urls import path

from agents import lease, views

urlpatterns = [
    path("register", views.RegisterView.as_view(), name="agent-register"),
    path("heartbeat", views.HeartbeatView.as_view(), name="agent-heartbeat"),
    path("scans", views.ScanUploadView.as_view(), name="agent-scans"),
    path("rotate", views.RotateView.as_view(), name="agent-rotate"),
    path("lease", lease.LeaseView.as_view(), name="agent-lease"),
]
