"""The gateway's REST API: API keys (create, change, rotate, revoke) and usage reports; thin callers of keys and usage.

Reading needs the view permission, changing the add or change permission
(the viewer and operator roles); every change is a KeyEvent with who and when.
A key's secret is in the answer to its creation and to a rotation, and nowhere else.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from gateway import keys, usage
from gateway.models import ApiKey
from gateway.serializers import (
    KeyConflictOut,
    KeyCreatedOut,
    KeyIn,
    KeyInErrors,
    KeyOut,
    KeyUpdateIn,
    UsageIn,
    UsageInErrors,
    UsageOut,
)
from llmgw.permissions import PermissionsRequired

CSV_COLUMNS = (
    "bucket",
    "key_id",
    "key_name",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "errors",
)


class CanChangeKeys(PermissionsRequired):
    """Rotating and revoking change a key: the change permission (POST is not "add" here)."""

    required = ("gateway.change_apikey",)


class CanViewUsage(PermissionsRequired):
    """The usage report reads usage rows and names keys."""

    required = ("gateway.view_usageminute", "gateway.view_apikey")


class KeyViewSet(viewsets.ModelViewSet):
    """Gateway API keys: the secret is answered once, on creation and on rotation; no delete (revoke instead)."""

    serializer_class = KeyOut
    filterset_fields = ["name", "owner"]
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_queryset(self):
        return ApiKey.objects.select_related("owner", "created_by")

    def list(self, request, *args, **kwargs):
        """A page of keys, each with its spend this day and month (one query for the page)."""
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        spent = usage.spent([k.id for k in page], timezone.now())
        return self.get_paginated_response(KeyOut(page, many=True, context={"spent": spent}).data)

    def _answer(self, key: ApiKey, *, secret: str | None = None, code: int = 200) -> Response:
        key = self.get_queryset().get(pk=key.pk)
        if secret is None:
            return Response(KeyOut(key).data, status=code)
        key.secret = secret
        return Response(KeyCreatedOut(key).data, status=code)

    @extend_schema(request=KeyIn, responses={201: KeyCreatedOut, 400: KeyInErrors})
    def create(self, request, *args, **kwargs):
        """Create a key; the answer holds its secret, shown this once."""
        data = KeyIn(data=request.data)
        data.is_valid(raise_exception=True)
        key, secret = keys.create_key(**data.validated_data, now=timezone.now(), actor=request.user)
        return self._answer(key, secret=secret, code=201)

    @extend_schema(request=KeyUpdateIn, responses={200: KeyOut, 400: KeyInErrors})
    def partial_update(self, request, *args, **kwargs):
        """Change a key's name, models, limits, budgets or expiry; each change recorded as old -> new."""
        data = KeyUpdateIn(self.get_object(), data=request.data)
        data.is_valid(raise_exception=True)
        key = keys.update(data.instance.id, data.validated_data, now=timezone.now(), actor=request.user)
        return self._answer(key)

    @extend_schema(request=None, responses={200: KeyCreatedOut, 409: KeyConflictOut})
    @action(detail=True, methods=["post"], permission_classes=[CanChangeKeys])
    def rotate(self, request, pk=None):
        """A new secret for the same key (its limits, budgets and usage stay); the old secret stops working."""
        try:
            key, secret = keys.rotate(self.get_object().id, now=timezone.now(), actor=request.user)
        except keys.KeyRefused as e:
            return Response({"detail": str(e)}, status=status.HTTP_409_CONFLICT)
        return self._answer(key, secret=secret)

    @extend_schema(request=None, responses={200: KeyOut, 409: KeyConflictOut})
    @action(detail=True, methods=["post"], permission_classes=[CanChangeKeys])
    def revoke(self, request, pk=None):
        """Revoke the key: every gateway refuses it within a second. Revoking twice is a 409."""
        key = self.get_object()
        if not keys.revoke(key.id, now=timezone.now(), actor=request.user):
            return Response({"detail": f"the key {key.name!r} is already revoked"}, status=status.HTTP_409_CONFLICT)
        return self._answer(key)


class UsageCSVRenderer(BaseRenderer):
    """The usage report's rows as CSV, one line a row, in CSV_COLUMNS' order."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        """The header line and one line per row (a column the grouping left out is empty)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\r\n")
        writer.writerow(CSV_COLUMNS)
        for row in data["rows"]:
            writer.writerow(["" if row.get(c) is None else row[c] for c in CSV_COLUMNS])
        return out.getvalue().encode("utf-8")


class UsageView(APIView):
    """Usage by key and model over a time range, in minute, hour or day buckets; JSON, or CSV (?format=csv)."""

    permission_classes = [CanViewUsage]
    renderer_classes = [JSONRenderer, UsageCSVRenderer]

    @extend_schema(
        parameters=[UsageIn],
        responses={
            (200, "application/json"): UsageOut,
            (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="The rows as CSV, with a header line."),
            (400, "application/json"): UsageInErrors,
        },
    )
    def get(self, request):
        """The report; a bad parameter is a 400 naming it."""
        params = UsageIn(data=request.query_params)
        params.is_valid(raise_exception=True)
        v = params.validated_data
        rows = usage.report(
            start=v["start"],
            end=v["end"],
            group_by=v["group_by"],
            bucket=v.get("bucket"),
            key_id=v.get("key"),
            model=v.get("model"),
        )
        body = UsageOut(
            {"start": v["start"], "end": v["end"], "group_by": v["group_by"], "bucket": v.get("bucket"), "rows": rows}
        ).data
        return Response(body)

    def finalize_response(self, request, response, *args, **kwargs):
        # A refusal is a JSON body whatever was asked for: the CSV renderer has no rows to write.
        response = super().finalize_response(request, response, *args, **kwargs)
        if response.status_code >= 400 and isinstance(getattr(response, "accepted_renderer", None), UsageCSVRenderer):
            response.accepted_renderer = JSONRenderer()
            response.accepted_media_type = "application/json"
        return response
