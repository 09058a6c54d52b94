"""The inventory REST API: nodes, GPUs, NVLink domains, the doctor, and the operator's actions.

Thin callers: every rule is in inventory/operations.py, shared with the admin.
"""

from __future__ import annotations

from django.db.models import Prefetch
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import filters, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from inventory import doctor, nvlink_view, operations
from inventory.filters import GPUFilter, NodeFilter
from inventory.models import GPU, Node
from inventory.nodes import TransitionError
from inventory.serializers import (
    ActionIn,
    ActionInErrors,
    DoctorReportOut,
    DrainOut,
    ForgetConflictOut,
    GPUOut,
    LabelsIn,
    LabelsInErrors,
    LabelsOut,
    NodeActionOut,
    NodeOut,
    RackOut,
    StateConflictOut,
)
from llmgw.permissions import ModelPermissions, PermissionsRequired, holds

# Which permission each operator action needs, beyond seeing the node.
ACTION_PERMISSIONS = {
    "cordon": "inventory.cordon_node",
    "uncordon": "inventory.cordon_node",
    "drain": "inventory.drain_node",
    "labels": "inventory.change_labels",
    "destroy": "inventory.forget_node",
}


class NodePermissions(ModelPermissions):
    """Reads need view_node; each action its own permission (a viewer may look, not act)."""

    def has_permission(self, request: Request, view) -> bool:
        perm = ACTION_PERMISSIONS.get(getattr(view, "action", None) or "")
        if perm is None:
            return super().has_permission(request, view)
        return holds(request.user, ["inventory.view_node", perm])


class CanViewNodes(PermissionsRequired):
    """Seeing the NVLink domains, or where the doctor finds trouble, is seeing the nodes."""

    required = ("inventory.view_node",)


def _nodes():
    return Node.objects.prefetch_related(
        Prefetch("gpus", queryset=GPU.objects.order_by("index")), "fabrics", "allocated_gpus"
    ).order_by("id")


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes with their GPUs and fabrics; cordon, uncordon, drain and labels as actions; DELETE forgets one."""

    serializer_class = NodeOut
    permission_classes = [NodePermissions]
    filterset_class = NodeFilter
    filter_backends = [*viewsets.ReadOnlyModelViewSet.filter_backends, filters.SearchFilter]
    search_fields = ["id", "hostname", "gpus__uuid"]
    # Node ids are host names: dots are part of them.
    lookup_value_regex = r"[^/]+"

    def get_queryset(self):
        return _nodes()

    def _transition(self, request: Request, pk: str, fn, name: str) -> Response:
        body = ActionIn(data=request.data)
        body.is_valid(raise_exception=True)
        node = self.get_object()
        affected = operations.live_replicas([node.id])[node.id] if name == "drain" else []
        try:
            fn(node.id, now=timezone.now(), actor=request.user, reason=body.validated_data["reason"])
        except TransitionError as exc:
            return Response({"state": [str(exc)]}, status=status.HTTP_409_CONFLICT)
        # Rendered by the serializers the API document declares, so the two cannot drift apart.
        node = _nodes().get(id=node.id)
        if name == "drain":
            return Response(DrainOut({"node": node, "replicas_to_move": affected}).data)
        return Response(NodeActionOut({"node": node}).data)

    @extend_schema(responses={204: None, 409: ForgetConflictOut})
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        """Forget a node gone for good; refused while it holds allocations or shards not stopped. Its history stays."""
        node = self.get_object()
        try:
            operations.forget(node.id, now=timezone.now(), actor=request.user)
        except operations.ForgetRefused as exc:
            return Response({"node": [str(exc)]}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=ActionIn, responses={200: NodeActionOut, 400: ActionInErrors, 409: StateConflictOut})
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        """Exclude the node from new placement; what runs there keeps running."""
        return self._transition(request, pk, operations.cordon, "cordon")

    @extend_schema(request=ActionIn, responses={200: NodeActionOut, 400: ActionInErrors, 409: StateConflictOut})
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        """Give a cordoned or draining node back to placement."""
        return self._transition(request, pk, operations.uncordon, "uncordon")

    @extend_schema(request=ActionIn, responses={200: DrainOut, 400: ActionInErrors, 409: StateConflictOut})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Move the node's replicas elsewhere; the answer lists those that will move."""
        return self._transition(request, pk, operations.drain, "drain")

    @extend_schema(request=LabelsIn, responses={200: LabelsOut, 400: LabelsInErrors})
    @action(detail=True, methods=["put", "patch"])
    def labels(self, request: Request, pk: str | None = None) -> Response:
        """Replace (PUT) or change (PATCH; null removes) the node's operator labels."""
        partial = request.method == "PATCH"
        body = LabelsIn(data=request.data, context={"partial": partial})
        body.is_valid(raise_exception=True)
        node = self.get_object()
        labels = body.validated_data["labels"]
        fn = operations.patch_labels if partial else operations.change_labels
        try:
            fn(node.id, labels, now=timezone.now(), actor=request.user)
        except operations.LabelError as exc:
            return Response({"labels": {exc.field: [exc.message]}}, status=status.HTTP_400_BAD_REQUEST)
        node.refresh_from_db()
        return Response(
            LabelsOut(
                {
                    "agent_labels": node.agent_labels,
                    "operator_labels": node.operator_labels,
                    "effective_labels": node.labels,
                }
            ).data
        )


class GPUViewSet(viewsets.ReadOnlyModelViewSet):
    """Every GPU of the cluster; filter by node, class or fabric state, search by UUID."""

    serializer_class = GPUOut
    queryset = GPU.objects.order_by("node_id", "index")
    filterset_class = GPUFilter
    filter_backends = [*viewsets.ReadOnlyModelViewSet.filter_backends, filters.SearchFilter]
    search_fields = ["uuid", "node__id", "name"]


class NVLinkView(APIView):
    """Multi-node NVLink domains: their trays, each card's state, and what keeps a tray out."""

    permission_classes = [CanViewNodes]

    @extend_schema(responses={200: RackOut(many=True)})
    def get(self, request: Request) -> Response:
        return Response(RackOut(nvlink_view.racks(), many=True).data)


class DoctorView(APIView):
    """The doctor's checks: their latest run, at most settings.LLMGW_DOCTOR_CACHE seconds old.

    `at` says when they ran; `?fresh=1` runs them now.
    """

    permission_classes = [CanViewNodes]

    @extend_schema(
        responses=DoctorReportOut,
        parameters=[OpenApiParameter("fresh", bool, description="run the checks now rather than reuse a recent run")],
    )
    def get(self, request: Request) -> Response:
        fresh = request.query_params.get("fresh", "").lower() in ("1", "true", "yes")
        at, results = doctor.latest(now=timezone.now(), fresh=fresh)
        return Response(DoctorReportOut(doctor.report(results, now=at)).data)
