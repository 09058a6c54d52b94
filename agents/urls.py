"""The agent endpoints, under /api/v1/agent/."""

from django.urls import path

from agents import api, lease

urlpatterns = [
    path("register", api.RegisterView.as_view(), name="agent-register"),
    path("heartbeat", api.HeartbeatView.as_view(), name="agent-heartbeat"),
    path("scans", api.ScanUploadView.as_view(), name="agent-scans"),
    path("rotate", api.RotateView.as_view(), name="agent-rotate"),
    path("lease", lease.LeaseView.as_view(), name="agent-lease"),
]
