"""The versioned REST API (/api/v1/): one router, each app registering its viewsets."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from inventory.doctor_api import DoctorView

router = DefaultRouter()

urlpatterns: list = [*router.urls]
urlpatterns += [path("doctor", DoctorView.as_view(), name="doctor")]
_ = path
