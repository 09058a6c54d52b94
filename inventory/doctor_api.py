"""`GET /api/v1/doctor`: the doctor's checks for scripts and dashboards."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from inventory import doctor
from inventory.api import CanViewNodes


class CheckResultSerializer(serializers.Serializer):
    """One check's answer."""

    name = serializers.CharField()
    result = serializers.ChoiceField(choices=[r.value for r in doctor.Result])
    summary = serializers.CharField()
    action = serializers.CharField(allow_blank=True)
    nodes = serializers.ListField(child=serializers.CharField())
    details = serializers.ListField(child=serializers.CharField())


class DoctorReportSerializer(serializers.Serializer):
    """The doctor's report: the worst verdict and every check."""

    at = serializers.DateTimeField()
    result = serializers.ChoiceField(choices=[r.value for r in doctor.Result])
    checks = CheckResultSerializer(many=True)


class DoctorView(APIView):
    """The doctor's checks: their latest run, at most settings.LLMGW_DOCTOR_CACHE seconds old.

    `at` says when they ran; `?fresh=1` runs them now.
    """

    permission_classes = [CanViewNodes]

    @extend_schema(
        responses=DoctorReportSerializer,
        parameters=[OpenApiParameter("fresh", bool, description="run the checks now rather than reuse a recent run")],
    )
    def get(self, request: Request) -> Response:
        fresh = request.query_params.get("fresh", "").lower() in ("1", "true", "yes")
        at, results = doctor.latest(now=timezone.now(), fresh=fresh)
        return Response(DoctorReportSerializer(doctor.report(results, now=at)).data)
