"""Placement's REST API: thin callers of placement's logic."""

from __future__ import annotations

from django.db.models import Count, ProtectedError, Q
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from llmgw.permissions import PermissionsRequired
from placement import audit, explain, kept, planner, replicas
from placement import deployments as deployment_actions
from placement.models import (
    AutoscaleSample,
    Deployment,
    EngineProfile,
    Hold,
    PlacementEvent,
    PowerBudget,
    Replica,
    Shard,
)
from placement.serializers import (
    AutoscaleIn,
    AutoscaleInErrors,
    AutoscaleSampleOut,
    DeploymentIn,
    DeploymentOut,
    DryRunIn,
    DryRunInErrors,
    DryRunOut,
    EventOut,
    HoldIn,
    HoldOut,
    PowerBudgetIn,
    PowerBudgetOut,
    ProfileIn,
    ProfileOut,
    ReplicaOut,
    ScaleIn,
    ScaleInErrors,
    ShardOut,
)


class CanChange(PermissionsRequired):
    """An action that changes a row needs the model's change permission (POST is not "add" here)."""

    def perms(self, request, view) -> list[str]:
        """The change permission of the view's model."""
        model = view.get_queryset().model
        return [f"{model._meta.app_label}.change_{model._meta.model_name}"]


class InOutViewSet(viewsets.ModelViewSet):
    """Validate writes with `input_class`, answer with `serializer_class`."""

    input_class: type

    def _write(self, request, instance=None, *, partial=False):
        data = self.input_class(instance, data=request.data, partial=partial, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        obj = self.perform_write(data)
        return Response(self.serializer_class(self._reload(obj)).data, status=201 if instance is None else 200)

    def _reload(self, obj):
        return self.get_queryset().get(pk=obj.pk)

    def perform_write(self, data):
        return data.save()

    def create(self, request, *args, **kwargs):
        return self._write(request)

    def update(self, request, *args, **kwargs):
        return self._write(request, self.get_object(), partial=kwargs.pop("partial", False))


class AuditedViewSet(InOutViewSet):
    """Writes through placement.audit: each create, change and delete recorded with who and when."""

    def perform_write(self, data):
        obj = data.instance or data.Meta.model()
        for field, value in data.validated_data.items():
            setattr(obj, field, value)
        return audit.save(obj, now=timezone.now(), actor=self.request.user)

    def perform_destroy(self, instance):
        audit.delete([instance], now=timezone.now(), actor=self.request.user)


class ProfileViewSet(AuditedViewSet):
    """Engine profiles: how a model is run."""

    queryset = EngineProfile.objects.all()
    serializer_class = ProfileOut
    input_class = ProfileIn
    filterset_fields = ["engine", "gpu_class", "name"]

    def destroy(self, request, *args, **kwargs):
        try:
            return super().destroy(request, *args, **kwargs)
        except ProtectedError as e:  # deployments still use it
            names = ", ".join(sorted(str(dep) for dep in e.protected_objects))
            why = f"still used by {names}: delete them or move them to another profile first"
            return Response({"deployments": [why]}, status=status.HTTP_409_CONFLICT)


class DeploymentViewSet(InOutViewSet):
    """Deployments: what should run. Changes queue a reconcile."""

    serializer_class = DeploymentOut
    input_class = DeploymentIn
    filterset_fields = ["name", "served_model", "pool", "paused", "profile", "policy"]

    def get_queryset(self):
        return Deployment.objects.select_related("profile").annotate(
            ready_replicas=Count("replica_set", filter=Q(replica_set__state="ready")),
            live_replicas=Count("replica_set", filter=Q(replica_set__state__in=replicas.LIVE_STATES)),
        )

    def perform_write(self, data):
        before = Deployment.objects.filter(pk=data.instance.pk).first() if data.instance is not None else None
        dep = data.save()
        what = deployment_actions.changed(before, dep)
        deployment_actions.record(
            dep,
            "changed",
            f"saved through the API: {what or 'nothing changed'}",
            now=timezone.now(),
            actor=self.request.user,
        )
        return dep

    def destroy(self, request, *args, **kwargs):
        why = deployment_actions.delete(self.get_object(), now=timezone.now(), actor=request.user)
        if why:
            return Response({"replicas": [why]}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=ScaleIn, responses={200: DeploymentOut, 400: ScaleInErrors})
    @action(detail=True, methods=["post"], permission_classes=[CanChange])
    def scale(self, request, pk=None):
        """Set the desired replicas."""
        data = ScaleIn(data=request.data)
        data.is_valid(raise_exception=True)
        dep = deployment_actions.scale(
            self.get_object(), data.validated_data["replicas"], now=timezone.now(), actor=request.user
        )
        return Response(self.serializer_class(self._reload(dep)).data)

    @extend_schema(request=AutoscaleIn, responses={200: DeploymentOut, 400: AutoscaleInErrors})
    @action(detail=True, methods=["post"], permission_classes=[CanChange])
    def autoscale(self, request, pk=None):
        """Set the autoscaling policy (fields left out keep their values; metric "" turns it off)."""
        dep = self.get_object()
        data = AutoscaleIn(dep, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        dep = deployment_actions.set_autoscale(dep, data.validated_data, now=timezone.now(), actor=request.user)
        return Response(self.serializer_class(self._reload(dep)).data)

    @extend_schema(responses=AutoscaleSampleOut(many=True), filters=False)
    @action(detail=True, methods=["get"], url_path="autoscale-samples")
    def autoscale_samples(self, request, pk=None):
        """What the autoscaler saw and set, pass by pass, oldest first (the last day)."""
        qs = AutoscaleSample.objects.filter(deployment_id=self.get_object().id).order_by("at", "id")
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(AutoscaleSampleOut(page, many=True).data)

    @extend_schema(request=None, responses=DeploymentOut)
    @action(detail=True, methods=["post"], permission_classes=[CanChange])
    def pause(self, request, pk=None):
        """Leave it alone: the reconciler neither starts nor stops its replicas."""
        dep = deployment_actions.set_paused(self.get_object(), True, now=timezone.now(), actor=request.user)
        return Response(self.serializer_class(self._reload(dep)).data)

    @extend_schema(request=None, responses=DeploymentOut)
    @action(detail=True, methods=["post"], permission_classes=[CanChange])
    def resume(self, request, pk=None):
        """Reconcile it again."""
        dep = deployment_actions.set_paused(self.get_object(), False, now=timezone.now(), actor=request.user)
        return Response(self.serializer_class(self._reload(dep)).data)


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Replicas with their shards; a pending one carries the planner's reason node by node."""

    serializer_class = ReplicaOut
    filterset_fields = {
        "deployment": ["exact"],
        "deployment__name": ["exact"],
        "state": ["exact", "in"],
        "shards__node": ["exact"],
        "nvlink_domain": ["exact"],
        "fabric": ["exact"],
    }

    def get_queryset(self):
        return Replica.objects.select_related("deployment").prefetch_related("shards").distinct()

    @extend_schema(responses=EventOut(many=True), filters=False)
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        """The replica's state changes, newest first."""
        qs = PlacementEvent.objects.filter(replica_id=self.get_object().id)
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(EventOut(page, many=True).data)


class ShardViewSet(viewsets.ReadOnlyModelViewSet):
    """Shards: one process of a replica on one node."""

    serializer_class = ShardOut
    filterset_fields = {
        "node": ["exact"],
        "state": ["exact", "in"],
        "replica": ["exact"],
        "replica__deployment": ["exact"],
    }

    def get_queryset(self):
        return Shard.objects.select_related("replica")


class EventViewSet(viewsets.ReadOnlyModelViewSet):
    """Placement events: who and what changed, and why."""

    queryset = PlacementEvent.objects.all()
    serializer_class = EventOut
    filterset_fields = ["deployment", "replica", "shard", "kind"]


class HoldViewSet(AuditedViewSet):
    """Holds: nothing new is placed on a node, a label value or a fabric."""

    queryset = Hold.objects.select_related("created_by")
    serializer_class = HoldOut
    input_class = HoldIn
    filterset_fields = ["scope", "node", "label_key", "label_value", "fabric"]
    http_method_names = ["get", "post", "delete", "head", "options"]


class PowerBudgetViewSet(AuditedViewSet):
    """Power budgets per label value."""

    queryset = PowerBudget.objects.all()
    serializer_class = PowerBudgetOut
    input_class = PowerBudgetIn
    filterset_fields = ["label_key", "label_value"]


class CanPlan(PermissionsRequired):
    """A dry run reads the cluster: it needs to view profiles and deployments."""

    required = ("placement.view_engineprofile", "placement.view_deployment")


class DryRunView(APIView):
    """Where would this go now, and why not elsewhere: the reconciler's planner over a fresh snapshot.

    Why not elsewhere is summarised (each reason with its node count and a few names, and some nodes that
    fit); `"explain": "all"` asks for every node's reason as well.
    """

    permission_classes = [CanPlan]

    @extend_schema(request=DryRunIn, responses={200: DryRunOut, 400: DryRunInErrors})
    def post(self, request):
        data = DryRunIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        dep = v.get("deployment")
        profile = v.get("profile") or dep.profile
        selector = v.get("node_selector", dep.node_selector if dep else {})
        policy = v.get("policy") or (dep.policy if dep else planner.BINPACK)
        snap = kept.scratch(now=timezone.now())
        req = planner.ReplicaRequest.from_profile(profile, selector=selector)
        every = v["explain"] == explain.EVERY_NODE
        plans = []
        for _ in range(v["replicas"]):
            result = planner.plan(req, snap, policy=policy, explain=True)
            plans.append(explain.shown(result, every=every))
            if not result.ok:
                break
            snap.reserve(result)
        return Response(DryRunOut({"placed": sum(1 for p in plans if p["ok"]), "plans": plans}).data)
